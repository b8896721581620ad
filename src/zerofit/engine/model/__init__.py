"""The model as the engine sees it: the shell and its blocks (adapter.py), its parameters materialized as the
store's flat buffers (materialize.py, with its progress in startup.py), parameter groups (groups.py), a frozen base
in 4 bits (nf4.py)."""

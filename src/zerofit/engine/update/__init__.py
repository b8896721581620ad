"""The optimizer's side of the engine: AdamW on flat buffers and who runs it when.

``adamw.py`` (a leaf: ``Hyper``, ``adamw_flat``, ``adamw_rollback``), ``split_adamw.py`` (the two-pass kernel),
``unit_adamw.py`` (one unit's step, per parameter group), ``speculation.py`` (speculative updates),
``worker.py`` (the CPU optimizer thread).
"""

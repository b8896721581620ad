"""Where each unit lives and what it costs: a plan and its shapes (plan.py), the placement search that chooses it
(search.py), and the engine's own plan, its inputs from the config and its replans (engine_plan.py)."""

"""Other libraries' names over the engine: DeepSpeed's engine (deepspeed_surface.py), the names it refuses
(deepspeed_names.py), the objects its initialize returns (deepspeed_views.py), its offload_states
(offload_states.py); torch.optim's optimizer and scheduler views for every door (views.py)."""

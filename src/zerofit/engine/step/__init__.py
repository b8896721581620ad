"""One step's work: the order of its compute (schedule.py), the model's own code over the units (compute.py), the
optimizer step (optimizer_step.py), the DeepSpeed-shaped accumulation window (window.py), the batch's checks
(batch.py), each step's hyperparameters (hypers.py), its clock (timeline.py), torch's clip for the user's loop
(torch_clip.py)."""

"""Optimizer-side pieces: learning-rate schedules, the fp16 loss scaler, AdamW."""

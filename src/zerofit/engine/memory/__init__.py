"""Where every tensor lives and how it moves: the units and their buffers (store.py), streamed weights up
(streamer.py), gradients down (grads.py), block checkpoints (activations.py), 16-bit host copies (copies16.py)."""

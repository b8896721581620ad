"""The NVMe tier: the state host memory cannot hold, streamed around each update (tier.py), in one preallocated
swap file (swapfile.py)."""

"""Several ranks and nodes: the process group and its collectives (ranks.py), a rank's failure (rank_failures.py),
named barriers (rendezvous.py), the units' shards (sharding.py), each node's slice of the host state
(node_slices.py), SLURM's launch as torchrun's (slurm.py)."""

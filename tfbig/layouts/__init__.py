"""What a sharded run's pieces hold, below every backend (tfbig-generate and consolidation read
them without one): tensor-parallel splits (tensor_layout.py), ZeRO partitions
(zero_checkpoint.py), pipeline stages and their cuts (stage_checkpoint.py, partition.py)."""

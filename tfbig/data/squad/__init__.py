"""SQuAD v1.1/v2.0 inputs: features with exact offsets (features.py), n-best post-processing
(postprocess.py) and the official evaluation (evaluate.py, tf-models-official's copy of the
SQuAD scripts). The task is tfbig.tasks.squad, the command tfbig-squad."""

"""SQuAD v1.1/v2.0 with ALBERT: features with exact offsets, fine-tuning, n-best post-processing,
and the official evaluation (tf-models-official's copy of the SQuAD scripts). CLI: tfbig-squad."""

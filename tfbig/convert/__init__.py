"""Published checkpoints in and out: Hugging Face / TF Hub / keras-hub BERT, ALBERT and GPT-2
as tfbig run directories (one table of names per family, shapes checked before anything is
written), tfbig runs back to Hugging Face, `--init_checkpoint` and the run-directory reader
(`run_dir.load_model`). The command is `tfbig-convert` (tfbig.commands.convert).
"""

"""Shared test set-up: quiet TensorFlow logs, oneDNN on, fp32 policy restored after each test."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# oneDNN's CPU allocator keeps the byte counts the memory tests read
# (tf.config.experimental.get_memory_info); TensorFlow turns oneDNN on by default on Intel
# CPUs only, and on an AMD EPYC the counts are "not available" without this.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import keras  # noqa: E402
import pytest  # noqa: E402

from tfbig.pipeline.devices import configure_cpu_devices  # noqa: E402

# In-process pipeline tests place stages on logical CPU devices, which must exist before
# TensorFlow runs its first op: set here, before any test module is collected, so any subset
# of the tests (tests/plan alone, say) sees the 4 devices the whole run does. If something
# initialised TensorFlow earlier, the pipeline strategy's own error says so in those tests.
try:
    configure_cpu_devices(4)
except RuntimeError:
    pass


@pytest.fixture(autouse=True)
def _reset_process_state():
    """Process-wide TF/Keras settings a test changes (mixed precision policy, op determinism
    from --deterministic runs) must not leak into the tests after it."""
    yield
    keras.mixed_precision.set_global_policy("float32")
    from tensorflow.python.framework import config as op_config

    op_config.disable_op_determinism()


@pytest.fixture(scope="session")
def shared():
    """`shared(key, compute)`: compute() once per session, then the same object for every test
    asking with an equal key (e.g. one single-device reference run that several distributed
    scenarios on the same data and flags are compared against). Callers only read it."""
    results = {}

    def get(key, compute):
        if key not in results:
            results[key] = compute()
        return results[key]

    return get


def _synthetic_corpus(directory, num_docs=60, seed=0):
    """Small play-like documents with learnable structure (speaker lines, repeated verse)."""
    import random

    rng = random.Random(seed)
    speakers = ["ROMEO", "JULIET", "NURSE", "MERCUTIO", "TYBALT"]
    words = ("love night light sweet death fair heaven wherefore art thou star moon speak "
             "sword blood name rose honour house gentle good noble").split()
    os.makedirs(directory, exist_ok=True)
    for d in range(num_docs):
        lines = []
        for _ in range(rng.randint(6, 14)):
            lines.append(rng.choice(speakers))
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 9))) + ".")
        with open(os.path.join(directory, f"doc{d:03d}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return directory


PLAYS = ("hamlet", "macbeth", "othello", "twelfth-night")  # twelfth-night: a validation play


@pytest.fixture(scope="session")
def scenes():
    """Scenes of a few embedded plays, as tfbig-prep's documents."""
    from tfbig.data import shakespeare

    texts = []
    for path in shakespeare.shakespeare_plays():
        if shakespeare.play_name(path) in PLAYS:
            with open(path, encoding="utf-8") as file:
                texts += shakespeare.play_scenes(file.read())
    return texts


@pytest.fixture(scope="session")
def scene_files(tmp_path_factory, scenes):
    """The scenes as text files, one per scene (a file is a document for tfbig-prep)."""
    root = tmp_path_factory.mktemp("scenes")
    for index, scene in enumerate(scenes):
        (root / f"scene{index:03d}.txt").write_text(scene, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory):
    """A tiny prepared GPT dataset: real TFRecord shards, manifest and tokenizer (seq 16)."""
    from tfbig.data import prepare

    root = tmp_path_factory.mktemp("gpt_data")
    corpus = _synthetic_corpus(str(root / "text"))
    out = str(root / "shards")
    prepare([corpus], out, seq_length=16, vocab_size=320, shard_size_mb=0.01,
            validation_fraction=0.2)
    return out


@pytest.fixture(scope="session")
def albert_data(tmp_path_factory):
    """A tiny prepared ALBERT dataset (standard BERT/ALBERT features, seq 32).

    Every sequence is full length and has exactly 2 masked predictions: the MLM loss is a mean
    over each replica's predictions (as in tf-models-official), which equals the mean over the
    global batch only when replicas hold equally many, so distributed runs can be compared
    with one device exactly."""
    from tfbig.data import prepare

    root = tmp_path_factory.mktemp("albert_data")
    corpus = _synthetic_corpus(str(root / "text"))
    out = str(root / "shards")
    prepare([corpus], out, seq_length=32, vocab_size=320, shard_size_mb=0.01,
            validation_fraction=0.2, format="albert",
            format_options={"max_predictions_per_seq": 2, "short_seq_prob": 0.0,
                            "dupe_factor": 2})
    return out


@pytest.fixture(scope="session")
def bert_data(tmp_path_factory):
    """A tiny prepared BERT dataset (WordPiece vocab trained on it, NSP pairs, seq 32).

    Every sequence has exactly 2 single-token predictions (masked_lm_prob 0.5 of at least 5
    tokens, capped at 2), so each replica's MLM mean equals the global one (see albert_data)."""
    from tfbig.data import prepare

    root = tmp_path_factory.mktemp("bert_data")
    corpus = _synthetic_corpus(str(root / "text"))
    out = str(root / "shards")
    prepare([corpus], out, seq_length=32, vocab_size=320, shard_size_mb=0.01,
            validation_fraction=0.2, format="bert",
            format_options={"max_predictions_per_seq": 2, "masked_lm_prob": 0.5,
                            "whole_word_masking": False, "short_seq_prob": 0.0,
                            "dupe_factor": 2})
    return out


MULTILINGUAL = ("Héllo, wörld!! Ça va? «Quoi»—naïve café...  東京は晴れ。\n\n"
                "Привет, мир! 42.5% (a+b)=c;\te-mail: x@y.z #tag $5 ~ `q` ÜNÏCÖDÉ "
                "it's they'll we've I'm   spaces  ¿Qué? 😀 naïve's IT'S 1234567 x    y\n")


@pytest.fixture(scope="session")
def gpt2_bpe(tmp_path_factory):
    """A tiny random GPT-2 with a byte-level BPE of ~300 tokens trained here, as a Hugging Face
    directory (config.json, model.safetensors, vocab.json, merges.txt), converted by
    tfbig-convert ("run"), and the synthetic corpus plus multilingual documents prepared with
    its tokenizer by tfbig-prep --tokenizer=<run> ("data", seq 16)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    from tfbig.commands.convert import ConvertOptions, convert
    from tfbig.data import prepare

    root = tmp_path_factory.mktemp("gpt2_bpe")
    corpus = _synthetic_corpus(str(root / "text"))
    for index in range(3):
        with open(os.path.join(corpus, f"world{index}.txt"), "w", encoding="utf-8") as file:
            file.write(MULTILINGUAL * (index + 2))
    texts = [open(os.path.join(corpus, name), encoding="utf-8").read()
             for name in sorted(os.listdir(corpus))]
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = root / "hf"
    hf.mkdir()
    backend.model.save(str(hf))
    with open(hf / "vocab.json", encoding="utf-8") as file:
        vocab_size = len(json.load(file))
    c, layers, positions = 24, 2, 40  # 3 heads of 8
    shapes = {"wte.weight": (vocab_size, c), "wpe.weight": (positions, c), "ln_f.weight": (c,),
              "ln_f.bias": (c,)}
    for i in range(layers):
        shapes.update({f"h.{i}.{name}": shape for name, shape in {
            "ln_1.weight": (c,), "ln_1.bias": (c,), "ln_2.weight": (c,), "ln_2.bias": (c,),
            "attn.c_attn.weight": (c, 3 * c), "attn.c_attn.bias": (3 * c,),
            "attn.c_proj.weight": (c, c), "attn.c_proj.bias": (c,),
            "mlp.c_fc.weight": (c, 4 * c), "mlp.c_fc.bias": (4 * c,),
            "mlp.c_proj.weight": (4 * c, c), "mlp.c_proj.bias": (c,)}.items()})
    rng = np.random.default_rng(0)
    save_file({name: (rng.normal(0.0, 0.2, shape) + (name.endswith("ln_1.weight")
                                                     or name.endswith("ln_2.weight")
                                                     or name == "ln_f.weight")).astype("float32")
               for name, shape in shapes.items()}, str(hf / "model.safetensors"),
              metadata={"format": "pt"})
    with open(hf / "config.json", "w") as file:
        json.dump({"model_type": "gpt2", "vocab_size": vocab_size, "n_positions": positions,
                   "n_embd": c, "n_layer": layers, "n_head": 3, "activation_function": "gelu_new",
                   "layer_norm_epsilon": 1e-5, "bos_token_id": 0, "eos_token_id": 0}, file)
    run = str(root / "run")
    convert(ConvertOptions(source=str(hf), output_dir=run))
    data = str(root / "data")
    prepare([corpus], data, seq_length=16, vocab_size=vocab_size, shard_size_mb=0.01,
            validation_fraction=0.2, tokenizer=run)
    return {"hf": str(hf), "run": run, "data": data, "texts": texts, "vocab_size": vocab_size}

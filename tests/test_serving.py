"""Serving: the SavedModel written by tfbig-export, loaded by a process that has only
TensorFlow (as TF Serving or a user's script would), gives the trained model's logits and
greedy tokens."""
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import tensorflow as tf

from test_trainer import make_cfg
from tfbig.commands.export import export
from tfbig.models.generation import Generator
from tfbig.training.trainer import Trainer

PROMPTS = [[1, 5, 9, 2, 11], [3, 3, 7, 8, 40]]
NEW_TOKENS = 6

# Runs in a fresh interpreter: TensorFlow and numpy only, no tfbig anywhere in the process.
CLIENT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf

    export_dir, prompts, new_tokens, out, request = sys.argv[1:]
    prompts, new_tokens = json.loads(prompts), int(new_tokens)
    request = json.loads(request)  # a TF Serving REST body, columnar ("inputs") format
    loaded = tf.saved_model.load(export_dir)
    ids = tf.constant(prompts, tf.int32)
    logits = loaded.signatures["serving_default"](token_ids=ids)["logits"].numpy()
    last = loaded.signatures["next_token_logits"](token_ids=ids)["logits"].numpy()
    for _ in range(new_tokens):  # greedy decoding: argmax of the last position, appended
        step = loaded.signatures["next_token_logits"](token_ids=ids)["logits"]
        ids = tf.concat([ids, tf.argmax(step, -1, output_type=tf.int32)[:, None]], 1)
    inputs = {k: tf.constant(v, tf.int32) for k, v in request["inputs"].items()}
    rest = loaded.signatures[request["signature_name"]](**inputs)["logits"].numpy()
    assert not [m for m in sys.modules if m.split(".")[0] == "tfbig"], "tfbig was imported"
    np.savez(out, logits=logits, last=last, greedy=ids.numpy(), rest=rest,
             signatures=np.array(sorted(loaded.signatures.keys())))
""")


def readme_request():
    """The JSON body of the TF Serving curl line in the export guide."""
    guide = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "guides",
                              "export-serve.md")).read()
    (body,) = re.findall(r"curl -s \S+:predict -d '([^']+)'", guide)
    return body


def serve_in_fresh_process(export_dir, out):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    argv = [export_dir, json.dumps(PROMPTS), str(NEW_TOKENS), out, readme_request()]
    proc = subprocess.run([sys.executable, "-c", CLIENT, *argv], env=env,
                          cwd=os.path.dirname(out), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)


def test_savedmodel_served_without_tfbig_equals_the_trained_model(gpt_data, tmp_path):
    trainer = Trainer(make_cfg(gpt_data, tmp_path / "run", max_steps=2))
    trainer.fit()
    export_dir = export(str(tmp_path / "run"), str(tmp_path / "export"))
    ids = tf.constant(PROMPTS, tf.int32)
    expected = trainer.model(ids, training=False).numpy()  # (B, T, V)
    greedy = Generator(trainer.model, jit_compile=False)(PROMPTS, NEW_TOKENS, temperature=0.0)

    served = serve_in_fresh_process(export_dir, str(tmp_path / "served.npz"))

    assert list(served["signatures"]) == ["next_token_logits", "serving_default"]
    assert served["logits"].shape == expected.shape and expected.std() > 1e-3
    np.testing.assert_allclose(served["logits"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(served["last"], expected[:, -1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(served["greedy"], greedy)
    request = json.loads(readme_request())
    assert served["rest"].shape == (len(request["inputs"]["token_ids"]), expected.shape[-1])

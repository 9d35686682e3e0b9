"""tfbig: train GPT and ALBERT with TensorFlow/Keras 3, from a laptop to GPU clusters."""
from setuptools import find_packages, setup

setup(
    name="tfbig",
    version="0.1.0",
    description="Large language model training (GPT, ALBERT) on TensorFlow/Keras 3 with Horovod, "
    "MultiWorkerMirroredStrategy and pipeline parallelism.",
    python_requires=">=3.11",
    packages=find_packages(include=["tfbig", "tfbig.*", "data_prep", "launch"]),
    install_requires=[
        "tensorflow==2.20.*",
        "absl-py>=1.4",
        "sentencepiece>=0.2.3",
        "tokenizers>=0.20",
        "psutil>=5.9",
        "safetensors>=0.4",
        "zstandard>=0.22",
        "mwparserfromhell>=0.6",
    ],
    extras_require={
        # TensorBoard's Profile tab for --profile_steps traces. The 2.20 line matches
        # TensorBoard 2.20; newer releases pull absl-py 2 over the pinned set.
        "profile": ["tensorboard-plugin-profile==2.20.*"],
        # tfbig-prep --runner=direct|dataflow|spark|flink. Beam pins protobuf<7, pyarrow<26, pillow<13 and
        # python-dateutil<3, below the TensorFlow 2.20 set here: install it in an environment of its own.
        "beam": ["apache-beam>=2.60"],
    },
    entry_points={
        "console_scripts": [
            "tfbig-prep=tfbig.commands.prep:run",
            "tfbig-train=tfbig.commands.train:run",
            "tfbig-generate=tfbig.commands.generate:run",
            "tfbig-squad=tfbig.commands.squad:run",
            "tfbig-export=tfbig.commands.export:run",
            "tfbig-profile=tfbig.commands.profile:run",
            "tfbig-launch=tfbig.commands.launch:run",
            "tfbig-plan=tfbig.commands.plan:run",
            "tfbig-convert=tfbig.commands.convert:run",
            "tfbig-classify=tfbig.commands.classify:run",
            "tfbig-doctor=tfbig.commands.doctor:run",
        ]
    },
)

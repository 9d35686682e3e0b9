"""Fixtures of the converter tests: Hugging Face's tf_model.h5 and TF-named model.safetensors
written by the writers transformers itself uses."""
import numpy as np
import pytest


@pytest.fixture(scope="session")
def write_tf_model_h5():
    """write(path, model_name, layers) -> the TF weight names written.

    `layers` is {top-level layer name: {TF weight name below the model's name: array}}, e.g.
    {"bert": {"bert/encoder/layer_._0/attention/self/query/kernel": ...}}. The file is written
    by Keras 2's HDF5 weight saver (tf_keras' `Model.save_weights("....h5")`), which is what
    transformers' `TFPreTrainedModel.save_pretrained` calls; variables are created under the
    same absolute name scopes transformers' TF models build theirs in, so every name is
    "<model name>/<layer>/.../<leaf>:0" and the attributes `layer_names` / `weight_names` are
    Keras' own.
    """
    def write(path, model_name, layers):
        model = _tf_keras_model(model_name, layers)
        model.save_weights(str(path))
        return [w.name for part in model.parts for w in part.weights]

    return write


@pytest.fixture(scope="session")
def write_tf_safetensors():
    """write(path, model_name, layers) -> the tensor names written: what transformers' TF
    `save_pretrained(dir, safe_serialization=True)` writes (modeling_tf_utils.py): over the
    variables `write_tf_model_h5` creates, {the weight's name less its first scope (transformers'
    strip_model_name_and_prefix): value} saved by safetensors' own TensorFlow writer with
    metadata {"format": "tf"}."""
    from safetensors.tensorflow import save_file

    def write(path, model_name, layers):
        model = _tf_keras_model(model_name, layers)
        tensors = {w.name.split("/", 1)[1]: w.value() for w in model.weights}
        save_file(tensors, str(path), metadata={"format": "tf"})
        return sorted(tensors)

    return write


def _tf_keras_model(model_name, layers):
    """A built tf_keras model named `model_name` holding `layers`' weights under their TF
    names."""
    import tensorflow as tf
    import tf_keras

    class Weights(tf_keras.layers.Layer):
        def __init__(self, values, **kwargs):
            super().__init__(**kwargs)
            for name, value in values.items():
                scope, leaf = name.rsplit("/", 1)
                with tf.name_scope(f"{model_name}/{scope}/"):  # trailing "/": absolute
                    self.add_weight(name=leaf, shape=value.shape, dtype=value.dtype.name,
                                    initializer=tf_keras.initializers.Constant(
                                        np.asarray(value)))

    class Model(tf_keras.Model):
        def __init__(self):
            super().__init__(name=model_name)
            self.parts = [Weights(values, name=layer) for layer, values in layers.items()]

        def call(self, x):
            return x

    model = Model()
    model(tf.zeros((1, 1)))
    return model

"""The numpy Example/TFRecord writer against TensorFlow's serializer and reader."""
import numpy as np
import tensorflow as tf

from tfbig.data import tfrecord


def _tf_example(features: dict) -> bytes:
    feature = {}
    for name, values in features.items():
        if np.issubdtype(values.dtype, np.floating):
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=values.tolist()))
        else:
            feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=values.tolist()))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def test_crc32c_known_values():
    # RFC 3720 test vectors: 32 zero bytes, 32 0xFF bytes, "123456789".
    crcs = tfrecord.crc32c([bytes(32), b"\xff" * 32, b"123456789", b""]).tolist()
    assert crcs == [0x8A9136AA, 0x62A8AB43, 0xE3069283, 0]


def test_examples_match_tensorflow_bytes():
    ids = np.array([[0, 1, 127, 128, 16383, 16384, 2**21, 2**40], [5, 6, 7, 8, 9, 10, 11, 2**62]])
    ours = tfrecord.encode_examples({"input_ids": ids})
    assert ours == [_tf_example({"input_ids": row}) for row in ids]


def test_float_and_multi_feature_examples_parse_back():
    ids = np.arange(12).reshape(3, 4)
    weights = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
    serialized = tfrecord.encode_examples({"ids": ids, "weights": weights})
    parsed = tf.io.parse_example(serialized, {"ids": tf.io.FixedLenFeature([4], tf.int64),
                                              "weights": tf.io.FixedLenFeature([2], tf.float32)})
    np.testing.assert_array_equal(parsed["ids"].numpy(), ids)
    np.testing.assert_array_equal(parsed["weights"].numpy(), weights)


def test_file_is_byte_identical_to_tf_writer(tmp_path):
    rng = np.random.default_rng(0)
    records = tfrecord.encode_examples({"input_ids": rng.integers(0, 70000, size=(40, 33))})
    records.append(b"")  # an empty record frames too
    with tfrecord.RecordWriter(str(tmp_path / "ours.tfrecord")) as writer:
        writer.write(records[:25])
        writer.write(records[25:])
    with tf.io.TFRecordWriter(str(tmp_path / "tf.tfrecord")) as writer:
        for record in records:
            writer.write(record)
    ours = (tmp_path / "ours.tfrecord").read_bytes()
    assert ours == (tmp_path / "tf.tfrecord").read_bytes()
    assert writer is not None and len(ours) > 0
    read = [r.numpy() for r in tf.data.TFRecordDataset(str(tmp_path / "ours.tfrecord"))]
    assert read == records


def test_writer_reports_sha256_and_size(tmp_path):
    import hashlib
    path = tmp_path / "x.tfrecord"
    with tfrecord.RecordWriter(str(path)) as writer:
        writer.write(tfrecord.encode_examples({"a": np.ones((3, 5), dtype=np.int64)}))
    assert writer.sha256.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert writer.num_bytes == path.stat().st_size

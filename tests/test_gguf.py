"""Our GGUF reader (kvfence.model.gguf_file) against gguf.GGUFReader, its errors, and a torch-free router."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvfence.model.describe import smollm2_gguf_path
from kvfence.model.gguf_file import GGUFFile, read_gguf


def reference(path: Path) -> tuple[dict, gguf.GGUFReader]:
    """What the loader read before: GGUFReader fields' contents(), without the ``GGUF.*`` pseudo keys."""
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, reader


def assert_same_as_reader(ours: GGUFFile, meta: dict, reader: gguf.GGUFReader) -> None:
    assert list(ours.metadata) == list(meta)
    for key, value in meta.items():
        mine = ours.metadata[key]
        assert type(mine) is type(value) and mine == value, key
        if isinstance(value, list):
            assert [type(v) for v in mine] == [type(v) for v in value], key
    assert ours.data_offset == reader.data_offset and len(ours.tensors) == len(reader.tensors)
    for t, ref in zip(ours.tensors, reader.tensors, strict=True):
        assert (t.name, list(t.shape), t.tensor_type) == (ref.name, ref.shape.tolist(), ref.tensor_type)
        assert (t.offset, t.nbytes, t.n_elements) == (ref.data_offset, ref.n_bytes, ref.n_elements)
        data = ours.tensor_data(t)  # same dtype, shape and bytes: gguf.quants.dequantize gives the same values
        assert (data.dtype, data.shape) == (ref.data.dtype, ref.data.shape), t.name
        assert data.tobytes() == ref.data.tobytes(), t.name


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, GGUFFile, float]:
    path = smollm2_gguf_path()
    t0 = time.perf_counter()
    ours = read_gguf(path)
    return path, ours, time.perf_counter() - t0


@pytest.mark.model
def test_bundled_gguf_reads_as_gguf_reader_does(smollm2):
    path, ours, seconds = smollm2
    meta, reader = reference(path)
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and len(meta["tokenizer.ggml.merges"]) > 48000
    assert_same_as_reader(ours, meta, reader)
    for ttype in {t.tensor_type for t in ours.tensors}:  # and dequantizes to the same values, once per type
        t = next(t for t in ours.tensors if t.tensor_type == ttype)
        ref = next(r for r in reader.tensors if r.name == t.name)
        dequantize = gguf.quants.dequantize
        assert np.array_equal(dequantize(ours.tensor_data(t), ttype), dequantize(ref.data, ttype)), t.name
    assert seconds < 2.0, f"parsing took {seconds:.2f}s"  # GGUFReader: 5-7 s


@pytest.mark.fast
def test_every_value_type_nested_arrays_and_alignment(tmp_path):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    for add, key, value in [
        (w.add_uint8, "u8", 250),
        (w.add_int8, "i8", -5),
        (w.add_uint16, "u16", 65000),
        (w.add_int16, "i16", -300),
        (w.add_uint32, "u32", 4_000_000_000),
        (w.add_int32, "i32", -7),
        (w.add_float32, "f32", 0.1),
        (w.add_bool, "b", True),
        (w.add_uint64, "u64", 2**63 + 5),
        (w.add_int64, "i64", -(2**40)),
        (w.add_float64, "f64", 0.1),
        (w.add_string, "s", "héllo"),
        (w.add_array, "ai", [1, 2, 3]),
        (w.add_array, "af", [0.5, 1.5]),
        (w.add_array, "as", ["a", "", "ü"]),
        (w.add_array, "ab", [True, False]),
        (w.add_array, "nested", [[1, 2], [3]]),
        (w.add_array, "nested_s", [["x"], ["y", "z"]]),
    ]:
        add(f"t.{key}", value)
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.arange(6, dtype=np.float16).reshape(2, 3))
    w.add_tensor("i32", np.arange(5, dtype=np.int32))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 256, dtype=np.float32).reshape(4, 64), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = read_gguf(path)
    assert ours.alignment == 64 and ours.data_offset % 64 == 0
    assert ours.metadata["t.nested"] == [1, 2, 3]  # flattened, as GGUFReader gives it
    assert_same_as_reader(ours, *reference(path))


@pytest.mark.model
@pytest.mark.parametrize("size", [0, 7, 24, 1000, 600_000])  # empty, mid-header, mid-metadata, in the vocabulary
def test_truncated_header_is_a_clear_error(tmp_path, size):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf_path(), "rb") as f:
        cut.write_bytes(f.read(size))
    with pytest.raises(ValueError, match=rf"{cut.name}.*(truncated|not a GGUF)"):
        read_gguf(cut)


@pytest.mark.model
def test_truncated_data_is_a_clear_error(tmp_path, smollm2):
    _, ours, _ = smollm2
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf_path(), "rb") as f:
        cut.write_bytes(f.read(ours.data_offset + 1000))
    with pytest.raises(ValueError, match=rf"{cut.name}: truncated.*past the end"):
        read_gguf(cut)


@pytest.mark.fast
def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    other = tmp_path / "model.gguf"
    other.write_bytes(b'{"not": "a gguf file"}' * 10)
    with pytest.raises(ValueError, match=rf"{other.name}: not a GGUF file"):
        read_gguf(other)


@pytest.mark.slow
def test_router_path_imports_no_torch():
    """What ``kvfence serve``'s parent and ``kvfence router`` import and run before serving: no torch."""
    code = """if True:
        import sys
        from kvfence import cli
        args = cli.build_parser().parse_args(["serve"])
        name, tokenizer, max_context = cli.describe(args)
        from kvfence.preflight import refuse_to_start_unless_fits
        from kvfence.workers.supervisor import Supervisor, free_tcp_address
        cli.worker_settings(args, "prefill", free_tcp_address(), free_tcp_address(), max_context, 2 * max_context)
        from kvfence.router.app import create_app
        from kvfence.router.remote import RemoteEngine
        import uvicorn
        assert max_context == 8192 and tokenizer.encode("hi"), (max_context, name)
        print("torch" in sys.modules)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "the router imports torch"

"""jaxserve's GGUF header reader reads what the gguf package's reader reads, and refuses damaged files."""

import gguf
import numpy as np
import pytest

from jaxserve.loader.gguf import GGUFFile
from jaxserve.loader.gguf_reader import GGUFReader

RNG = np.random.default_rng(0)
TENSORS = {  # name -> (array, stored as)
    "f32": (RNG.standard_normal((3, 5)).astype(np.float32), gguf.GGMLQuantizationType.F32),
    "f16": (RNG.standard_normal((2, 64)).astype(np.float16), gguf.GGMLQuantizationType.F16),
    "q8_0": (RNG.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
    "q4_1": (RNG.standard_normal((2, 3, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1),
    "bf16": (RNG.standard_normal((2, 32)).astype(np.float32), gguf.GGMLQuantizationType.BF16),
    "i32": (np.arange(7, dtype=np.int32), gguf.GGMLQuantizationType.I32),
}


def write(path, alignment=None):
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_uint32("a.u32", 7)
    writer.add_int32("a.i32", -3)
    writer.add_uint64("a.u64", 1 << 40)
    writer.add_float32("a.f32", 0.5)
    writer.add_float64("a.f64", 0.25)
    writer.add_bool("a.bool", True)
    writer.add_uint8("a.u8", 255)
    writer.add_int16("a.i16", -300)
    writer.add_string("a.str", "héllo ▁world")
    writer.add_array("a.strings", ["<s>", "", "ĠĊ", "日本"])
    writer.add_array("a.floats", [0.5, -1.25, 3.0])
    writer.add_array("a.ints", [1, -2, 3])
    writer.add_array("a.bools", [True, False])
    for name, (array, kind) in TENSORS.items():
        stored = array if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                                   gguf.GGMLQuantizationType.I32) else gguf.quants.quantize(array, kind)
        writer.add_tensor(name, stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_fields_and_tensors_equal_the_gguf_packages_reading(tmp_path, alignment):
    path = write(tmp_path / "m.gguf", alignment)
    ours, theirs = GGUFReader(path), gguf.GGUFReader(str(path))
    expected = {key: (f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
                for key, f in theirs.fields.items() if not key.startswith("GGUF.")}
    assert {key: (f.value, f.type, f.element_type) for key, f in ours.fields.items()} == expected
    assert ours.fields["a.strings"].value == ["<s>", "", "ĠĊ", "日本"] and ours.fields["a.u64"].value == 1 << 40
    assert [t.name for t in ours.tensors] == list(TENSORS)
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type and mine.shape == tuple(reference.shape.tolist())
        np.testing.assert_array_equal(mine.data, reference.data)
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        array, kind = TENSORS[mine.name]
        values = mine.data if kind == gguf.GGMLQuantizationType.I32 else gguf.quants.dequantize(mine.data, kind)
        np.testing.assert_allclose(values, array.astype(np.float32), atol=0.3 if kind.name.startswith("Q4") else 0.05)


def test_a_truncated_or_foreign_file_is_refused_with_a_reason(tmp_path):
    whole = write(tmp_path / "m.gguf").read_bytes()
    for size, reason in [(len(whole) - 100, "runs past the end of the file"), (200, "damaged header"),
                         (len(whole) // 2, "past the end")]:
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(whole[:size])
        with pytest.raises(ValueError, match=reason):
            GGUFReader(cut)
        with pytest.raises(ValueError, match="is not a readable GGUF file .* re-download it"):
            GGUFFile(cut)
    foreign = tmp_path / "model.gguf"
    foreign.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="no GGUF magic"):
        GGUFReader(foreign)


@pytest.mark.parametrize("version, reason", [((3).to_bytes(4, "big"), "big-endian GGUF .* without --bigendian"),
                                             ((1).to_bytes(4, "little"), "GGUF version 1, and this reader reads")])
def test_a_file_of_another_kind_says_so_not_that_it_is_truncated(tmp_path, version, reason):
    whole = write(tmp_path / "m.gguf").read_bytes()
    other = tmp_path / "other.gguf"
    other.write_bytes(whole[:4] + version + whole[8:])
    with pytest.raises(ValueError, match=reason) as refused:
        GGUFFile(other)
    assert "truncated" not in str(refused.value)


def test_a_tensor_type_the_gguf_package_does_not_know_is_named_not_called_truncated(tmp_path):
    whole = bytearray(write(tmp_path / "m.gguf").read_bytes())
    name = whole.index(b"\x03\x00\x00\x00\x00\x00\x00\x00f32") + 8 + 3  # then its dimension count, dims and type
    type_at = name + 4 + 8 * int.from_bytes(whole[name:name + 4], "little")
    whole[type_at:type_at + 4] = (250).to_bytes(4, "little")
    newer = tmp_path / "newer.gguf"
    newer.write_bytes(bytes(whole))
    with pytest.raises(ValueError, match=r"newer.gguf: tensor f32 is of GGML type 250, which the installed gguf "
                                         r"package \(.*\) does not know: upgrade it") as refused:
        GGUFFile(newer)
    assert "truncated" not in str(refused.value)

"""A quantized checkpoint tensor kept in its groups on the host: integer values, and a scale (and offset) per
`group` consecutive values along one axis, w = q * scale + offset.

It goes through the loader's HF-layout -> our-layout transforms (transpose, reshape, row permutations, stacking
over layers) like a float tensor, the values and their scales together, so every weight table is written once.
runner/weights.py pads it for the mesh and packs 4-bit values two to a byte; models/layers.py dequantizes it
inside the step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from jaxserve.models.layers import Grouped


@dataclasses.dataclass
class GroupedArray:
    values: np.ndarray  # one q per weight element: 0..15 (uint8) for 4-bit formats, int8 or float8 e4m3 otherwise
    scale: np.ndarray  # float32, the values' shape with `axis` divided by the group size
    offset: np.ndarray | None  # float32 like `scale`, or None (w = q * scale)
    axis: int  # the group axis
    bits: int  # 4 or 8: how the values are stored on the devices

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def group(self) -> int:
        return self.values.shape[self.axis] // self.scale.shape[self.axis]

    @property
    def format(self) -> Grouped:
        return Grouped(bits=self.bits, group=self.group, offset=self.offset is not None,
                       float8=self.values.dtype.name == "float8_e4m3fn", float4=self.values.dtype.name == "float4_e2m1fn")

    def _parts(self, fn: Callable[[np.ndarray], np.ndarray], axis: int) -> GroupedArray:
        return GroupedArray(fn(self.values), fn(self.scale), None if self.offset is None else fn(self.offset),
                            axis, self.bits)

    @property
    def T(self) -> GroupedArray:
        return self._parts(lambda a: a.T, self.ndim - 1 - self.axis)

    def astype(self, dtype, copy: bool = True) -> GroupedArray:
        """Itself: a float dtype asked of a weight kept in groups applies once it is dequantized (in the step)."""
        return self

    def __getitem__(self, index) -> GroupedArray:
        """Values and scales indexed alike, along axes other than the group axis (gpt-oss's gate and up columns,
        `w[..., ::2]`); the group axis must come through whole."""
        part = self._parts(lambda a: a[index], self.axis)
        if part.ndim != self.ndim or part.shape[self.axis] != self.shape[self.axis]:
            raise ValueError(f"index {index!r} cuts the group axis {self.axis} of a weight kept in groups")
        return part

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> GroupedArray:
        """`fn` (a permutation or slice of the leading axis) applied to the values and their scales alike."""
        assert self.axis != 0, "the rows are the group axis"
        return self._parts(fn, self.axis)

    def reshape(self, *shape: int) -> GroupedArray:
        """Axes split or merged, the group axis only split, each group kept within its innermost part."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        before, through = math.prod(self.shape[:self.axis]), math.prod(self.shape[:self.axis + 1])
        ends = [math.prod(shape[:i]) for i in range(len(shape) + 1)]
        if before not in ends or through not in ends or shape[ends.index(through) - 1] % self.group:
            raise ValueError(f"a weight quantized in groups of {self.group} along axis {self.axis} of {self.shape} "
                             f"cannot be reshaped to {shape}: the groups would straddle axes")
        axis = ends.index(through) - 1
        scale_shape = shape[:axis] + (shape[axis] // self.group,) + shape[axis + 1:]
        return GroupedArray(self.values.reshape(shape), self.scale.reshape(scale_shape),
                            None if self.offset is None else self.offset.reshape(scale_shape), axis, self.bits)

    def conform(self, target: Grouped) -> GroupedArray:
        """The same weights in `target`'s storage (a stacked weight's layers may come in different GGUF types):
        its smaller groups (scales repeated), wider values, offsets (zeros where it had none). Exact."""
        assert self.group % target.group == 0 and target.bits >= self.bits and (target.offset or self.offset is None)
        assert target.float8 == (self.format.float8 and target.bits == self.bits), (self.format, target)
        assert target.float4 == self.format.float4, (self.format, target)
        repeat = self.group // target.group
        scale = np.repeat(self.scale, repeat, self.axis)
        offset = (np.zeros_like(scale) if self.offset is None else np.repeat(self.offset, repeat, self.axis)) \
            if target.offset else None
        values = self.values.astype(np.int8) if target.bits > self.bits else self.values
        return GroupedArray(values, scale, offset, self.axis, target.bits)

    def dequantize_by_columns(self, column_groups: np.ndarray) -> np.ndarray:
        """The float32 weights of a [out, in] tensor whose input columns are not grouped in order (GPTQ's
        act-order): column i takes group column_groups[i]'s scale and offset."""
        w = self.values.astype(np.float32) * self.scale[:, column_groups]
        return w if self.offset is None else w + self.offset[:, column_groups]

    def dequantize(self) -> np.ndarray:
        """The float32 weights, as the checkpoint's own dequantization computes them (q * scale + offset)."""
        blocks = (self.values.shape[:self.axis] + (self.scale.shape[self.axis], self.group)
                  + self.values.shape[self.axis + 1:])
        w = self.values.reshape(blocks).astype(np.float32) * np.expand_dims(self.scale, self.axis + 1)
        if self.offset is not None:
            w = w + np.expand_dims(self.offset, self.axis + 1)
        return w.reshape(self.shape)


def shuffled_groups(column_groups: np.ndarray, groups: int) -> np.ndarray | None:
    """A checkpoint's group index per input column (`g_idx`) where it is not simply column // group size (GPTQ's
    act-order), else None: only groups of consecutive columns can be kept."""
    column_groups = column_groups.astype(np.int64)
    in_order = np.arange(len(column_groups)) // (len(column_groups) // groups)
    return None if np.array_equal(column_groups, in_order) else column_groups


def uneven_groups(name: str, columns: int, groups: int, group_size: int | None) -> np.ndarray | None:
    """Each input column's group where a checkpoint's groups of `group_size` (its config's; None or <= 0: one
    group a row) do not tile the `columns` evenly (the last one shorter: groups are counted rounding up, as
    compressed-tensors, AutoGPTQ and AutoAWQ count them), else None (whole groups, kept as they are); a ValueError
    where `groups` scales fit neither."""
    if group_size is None or group_size <= 0:
        expected, group_size = 1, columns
    else:
        expected = -(-columns // group_size)
    if groups != expected:
        raise ValueError(f"{name} has {groups} groups of scales for {columns} input columns in groups of "
                         f"{group_size}: the checkpoint is not what its quantization_config describes")
    return None if expected == 1 or columns % group_size == 0 else np.arange(columns) // group_size


def common_format(formats: list[Grouped]) -> Grouped | None:
    """The storage every one of `formats` converts into exactly (GroupedArray.conform); None if there is none
    (float8 or float4 values beside integer ones)."""
    if len({(f.float8, f.float4) for f in formats}) > 1:
        return None
    return Grouped(bits=max(f.bits for f in formats), group=math.gcd(*(f.group for f in formats)),
                   offset=any(f.offset for f in formats), float8=formats[0].float8, float4=formats[0].float4,
                   channel=all(f.channel for f in formats))


def stack_grouped(parts: list[GroupedArray], counts: tuple[int, ...]) -> GroupedArray:
    """Tensors of one weight (each layer's, each expert's) stacked on leading `counts` axes."""
    def stacked(arrays: list[np.ndarray]) -> np.ndarray:
        out = np.empty((len(arrays),) + arrays[0].shape, arrays[0].dtype)
        for i, a in enumerate(arrays):
            out[i] = a
        return out.reshape(counts + arrays[0].shape)

    first = parts[0]
    return GroupedArray(stacked([p.values for p in parts]), stacked([p.scale for p in parts]),
                        None if first.offset is None else stacked([p.offset for p in parts]),
                        first.axis + len(counts), first.bits)


def pack_nibbles(values: np.ndarray, axis: int) -> np.ndarray:
    """4-bit values (0..15) two to a byte along `axis`: element 2i in the low nibble, 2i+1 in the high one.
    models/layers.dequantized unpacks them."""
    pairs = values.reshape(values.shape[:axis] + (values.shape[axis] // 2, 2) + values.shape[axis + 1:])
    return (pairs.take(0, axis=axis + 1) | (pairs.take(1, axis=axis + 1) << 4)).astype(np.uint8)

"""How a model is laid out on a tp x pp mesh: the layer partition over stages and the padding that makes every
split even. The runner works on an *effective* ModelConfig with the padded sizes; the user-facing config keeps
the checkpoint's real numbers.

Every padding is exact:
- q/kv heads: with K kv heads and G q heads per kv head, K is padded with zero heads to K_pad (a multiple of tp
  when K >= tp, else the smallest divisor of tp >= K), and when K_pad < tp each kv head is replicated
  rep = tp / K_pad times so every device holds whole groups. G is padded to G_pad (a multiple of rep). q heads
  stay kv-major ([K_pad, G_pad] flattened), so q head h attends with kv head h // (G_pad / rep), which is a
  copy of real kv head h // G_pad. Padded q heads have zero `wo` rows and contribute nothing.
- MLP width (each expert's too, unless whole experts split), vocabulary and, with expert parallelism, experts:
  zero columns/rows appended (padded logits are sliced off, padded experts are never routed to). An MLP width
  that tp does not divide is padded to a multiple of tp x 128 (`split_width`).
- layers: every stage gets the same number of layer slots; a stage with fewer real layers ends in zero-weight
  layers, which are identities (x + 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.config import ModelConfig


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# A contracted width split over tp that tp does not divide is padded so that each device's share is a multiple of
# 128: a checkpoint's quantized groups (up to 128 columns, loader/weights.MAX_GROUP) then never straddle two
# devices, and each share is whole tiles of the accelerators' 128-wide matmul units. Padded to a multiple of tp
# alone, a 3-way split of 256 columns left each device 86, groups of 2 no kernel keeps. A width tp divides is
# left as it is (its groups narrow to fit instead, exact).
SPLIT_ALIGN = 128


def split_width(width: int, tp: int) -> int:
    return width if width % tp == 0 else round_up(width, tp * SPLIT_ALIGN)


def default_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """vLLM's rule (`get_pp_indices`): an even share each, and the remainder r adds one layer to each of the r
    stages just before the last one (second-to-last, then backwards); the last stage also runs the final norm
    and LM head, so it never gets an extra layer. 30 layers on 4 stages -> (7, 8, 8, 7); on 8 -> (3, 4, 4, 4, 4,
    4, 4, 3)."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


def check_partition(partition: Sequence[int], num_layers: int, pp: int) -> tuple[int, ...]:
    parts = tuple(int(p) for p in partition)
    text = ",".join(map(str, parts))
    if len(parts) != pp:
        raise ValueError(f"pp_layer_partition {text} has {len(parts)} stages but the mesh has pp={pp}; "
                         f"give one layer count per stage")
    if min(parts) < 1:
        raise ValueError(f"pp_layer_partition {text} gives a stage no layers; every stage needs at least one")
    if sum(parts) != num_layers:
        raise ValueError(f"pp_layer_partition {text} sums to {sum(parts)} but the model has {num_layers} layers; "
                         f"make the counts add up to {num_layers}")
    return parts


@dataclass(frozen=True)
class HeadPlan:
    kv_heads: int  # K_pad: real kv heads plus zero ones
    replicas: int  # rep: copies of each kv head, so that K_pad * rep divides over tp
    group: int  # G_pad: q heads per (unreplicated) kv head, real plus zero ones


def plan_heads(num_heads: int, num_kv_heads: int, tp: int) -> HeadPlan:
    K, G = num_kv_heads, num_heads // num_kv_heads
    if K >= tp:
        return HeadPlan(round_up(K, tp), 1, G)
    k_pad = next(k for k in range(K, tp + 1) if tp % k == 0)
    rep = tp // k_pad
    return HeadPlan(k_pad, rep, round_up(G, rep))


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    partition: tuple[int, ...]  # real layers per stage
    heads: HeadPlan
    mlp: int  # F, padded (dense models)
    vocab: int  # V, padded
    experts: int  # E, padded when whole experts split over tp (mixture-of-experts models; 0 otherwise)
    shared_mlp: int = 0  # the shared expert's MLP width, padded (Qwen2-MoE; 0 otherwise)

    @property
    def slots(self) -> int:
        """Layer slots per stage: the largest stage; smaller ones end in zero-weight layers."""
        return max(self.partition)

    def layer_slots(self) -> list[int]:
        """Slot index (in the stacked, padded `layers` axis) of each real layer, in order."""
        return [stage * self.slots + i for stage, n in enumerate(self.partition) for i in range(n)]

    def effective_config(self, cfg: ModelConfig) -> ModelConfig:
        h = self.heads
        # Expert parallelism splits whole experts over tp, not each expert's MLP width.
        mlp = cfg.intermediate_size if cfg.expert_parallel else self.mlp
        return dataclasses.replace(
            cfg, num_layers=self.pp * self.slots, num_heads=h.kv_heads * h.group,
            num_kv_heads=h.kv_heads * h.replicas, intermediate_size=mlp, vocab_pad=self.vocab - cfg.vocab_size,
            expert_pad=self.experts - cfg.num_experts, shared_expert_size=self.shared_mlp)


def plan_layout(cfg: ModelConfig, tp: int, pp: int, partition: Sequence[int] | None = None) -> ParallelLayout:
    if pp > cfg.num_layers:
        raise ValueError(f"pp={pp} is more pipeline stages than the model's {cfg.num_layers} layers; "
                         f"use pp <= {cfg.num_layers}")
    check_expert_parallel(cfg, tp)
    parts = default_partition(cfg.num_layers, pp) if partition is None else check_partition(partition,
                                                                                           cfg.num_layers, pp)
    return ParallelLayout(tp=tp, pp=pp, partition=parts, heads=plan_heads(cfg.num_heads, cfg.num_kv_heads, tp),
                          mlp=split_width(cfg.intermediate_size, tp), vocab=round_up(cfg.vocab_size, tp),
                          experts=round_up(cfg.num_experts, tp) if cfg.expert_parallel else cfg.num_experts,
                          shared_mlp=split_width(cfg.shared_expert_size, tp))


def check_expert_parallel(cfg: ModelConfig, tp: int) -> None:
    if not cfg.expert_parallel:
        return
    if not cfg.num_experts:
        raise ValueError(f"expert parallelism (--enable-expert-parallel) needs a mixture-of-experts model; "
                         f"{cfg.architecture} has a dense MLP: drop the flag")
    if tp > cfg.num_experts:
        raise ValueError(f"expert parallelism splits whole experts over the {tp} tensor-parallel devices, but the "
                         f"model has only {cfg.num_experts} experts; use tp <= {cfg.num_experts} or drop "
                         f"--enable-expert-parallel (each expert's MLP width then splits instead)")


def describe(layout: ParallelLayout, device_grid) -> str:
    """One log line per stage: its layers and which device holds each tp rank. `device_grid` is [pp, tp]."""
    lines = [f"mesh {layout.tp}x{layout.pp} (tp x pp), layer partition {list(layout.partition)}, "
             f"{layout.heads.kv_heads * layout.heads.group} q / {layout.heads.kv_heads * layout.heads.replicas} "
             f"kv heads after padding"]
    first = 0
    for stage, n in enumerate(layout.partition):
        ranks = ", ".join(f"tp{r}={d.id}" for r, d in enumerate(device_grid[stage]))
        lines.append(f"  stage {stage}: layers {first}-{first + n - 1} on devices {ranks}")
        first += n
    return "\n".join(lines)

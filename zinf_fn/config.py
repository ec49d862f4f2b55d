"""``zf.Config``: where each model state lives and how a step runs. Plain frozen data."""

from __future__ import annotations

import dataclasses

import torch

from .io import odirect
from .io.buffers import canonical_device
from .offload.protocol import NVME_ENGINES, PLACEMENTS
from .optim.formats import FROZEN_STORAGES, MASTERS, check_choice

ROUNDINGS = ("nearest_even", "ties_away")  # Config.param_rounding


@dataclasses.dataclass(frozen=True)
class Config:
    """Placements are "none" (stay on the compute device), "cpu" or "nvme" (tensorstore under
    ``nvme_path``).

    offload_params       where the 16-bit parameter copy lives; "auto": on the compute device up to
                         ``device_memory_budget`` (CPU compute: ``host_memory_budget``), the rest
                         spilled to "cpu" (CUDA) or "nvme" (see ``spill_params``; ``zf.init``
                         resolves it)
    offload_optimizer    where the fp32 master, the optimizer moments and stashed gradients live;
                         "auto": "cpu" up to ``host_memory_budget``, the rest spilled to "nvme"
    param_dtype          dtype of the stored, moved and gathered parameter copy
    compute_dtype        None: bf16 on CUDA, fp32 on CPU
    grad_accum           micro-batches per step (the batch's leading dimension is split k ways)
    clip_grad_norm       global-norm clipping threshold (two-pass update), None for none
    prefetch_depth       units fetched ahead of compute (0: every fetch on demand)
    update_workers       background workers for the streamed optimizer update (0: inline)
    device               compute device; None: CUDA when available, else CPU
    offload_activations  where the layer-boundary checkpoints live between forward and backward
    trace                path of a Chrome trace (JSON, opens in Perfetto) of every step's spans, or
                         None
    partition            data parallelism: "allgather" (rank r stores shard r of every unit) or
                         "broadcast" (the baseline: each unit stored whole by one rank, round-robin;
                         see sharding.py)
    collective_timeout_s how long a collective may wait for the other ranks before a CollectiveError
                         names it
    staging_buffers      most staging buffers of one (size, dtype) the pool may make; 0: what the
                         streaming parts declare (zf.estimate's plan of the pool, made at init)
    nvme_engine          how the NVMe tier moves rows, on the same zarr3 files: "direct" (O_DIRECT
                         row files, zinf_fn.io.direct_files) or "tensorstore" (tensorstore's zarr3
                         driver: the fallback where a file system refuses O_DIRECT, and the way to
                         storage only tensorstore reaches)
    host_memory_budget   bytes of host memory the run may use at its peak (states and working
                         memory), or None (no check); ``zf.init`` raises before allocating when the
                         estimate exceeds it
    device_memory_budget the same for the compute device's memory (CUDA)
    spill_params         "<k>:<placement>": the rows of units k.. (scan order: 0 the embedding, 1..L
                         the blocks, L+1 the head) live in the slower tier <placement> instead of
                         ``offload_params``; e.g. offload_params="none", spill_params="3:cpu"
    spill_optimizer      the same for the optimizer's rows, e.g. offload_optimizer="cpu",
                         spill_optimizer="5:nvme" (embedding and blocks 0..3 in RAM, the rest on
                         NVMe)
    optimizer_piece_bytes
                         the streamed update (optimizer on NVMe) reads, updates and writes a unit's
                         moments (and its master and stashed gradient, where no backward fetch
                         shares the master) in pieces of this many fp32 bytes, read ahead and
                         written behind per piece: the optimizer's host memory is O(pieces in
                         flight), not O(layer). A positive multiple of the O_DIRECT alignment
                         (``io.odirect.ALIGN``, 4096); the same pieces cut every tier's update
    master               how the optimizer tier keeps the fp32 master: "fp32", or "remainder" (needs
                         ``param_dtype=torch.bfloat16``): the bf16 parameter copy is the master's
                         high half and the tier keeps a 16-bit remainder, copy + remainder == the
                         fp32 master bit for bit (``optim.remainder``; 2 bytes an element instead of
                         4)
    param_rounding       how an fp32 master is rounded to the bf16 copy: "nearest_even" (torch's
                         cast), or "ties_away" (round to nearest, exact ties away from zero:
                         ``optim.remainder``'s copy); None: "ties_away" with ``master="remainder"``
                         (the only rounding a 16-bit remainder can undo), else "nearest_even".
                         ``master="fp32"`` with "ties_away" is the remainder run's fp32 twin: the
                         same bits, with the master stored whole
    host_mmap_threshold  host allocations of at least this many bytes get their own mapping,
                         unmapped when freed (glibc ``mallopt``; process-wide), so a step's
                         temporaries do not grow malloc's heap (``io.heap``). None: 1 MiB where a
                         state kind is on NVMe, else malloc's own threshold; 0: leave malloc alone
    keep_activations     bytes of the activations a step's recorded blocks may keep from forward to
                         backward (``scan.tape.Kept``): a block whose saved activations fit is not
                         recomputed in backward, its saved views of parameters rebuilt on the
                         refetched layer (the same bits); 0 (the default): every block is
                         recomputed. Cheap where activations are small against the compute (few
                         tokens a step, a frozen base: LoRA; docs/lora.md). Tiled blocks too: a
                         kept block's backward fetches each tile (each touched streamed expert)
                         once, not again for a recompute, and the tile plan leaves the recompute's
                         fetches out (``tiling.routed.Routes.keep``)
    keep_tiles           bytes of frozen streamed tiles (a LoRA base's experts, never written after
                         init) a training step keeps from their forward fetch into their backward
                         (``tiling.keep``): a kept tile is read once a step, not twice, its
                         backward fetch taking the forward's buffer. The first tiles a forward
                         fetches are kept while the budget holds one more of each streamed group (a
                         touched expert brings one tile of each); each goes back as its layer's
                         backward unit leaves. The pool reserves the budget's buffers at init
                         (resident from then on). One rank only (with several, a fetch issued
                         ahead may race the keep, and each fetch is a collective); 0 (the
                         default): nothing kept. ``zf.auto_config`` with a host budget and a
                         batch sets it to the budget's room above the chosen placement's
                         estimate, at most the bytes a step's forward reads
    reuse_blocks         the forward's last k blocks stay fetched (their gathered layers held) into
                         the backward, which uses them instead of fetching them again: k fewer block
                         reads a step, for k more layers held at the turn (``units.reused``; the
                         fetcher's demand counts them). 0 (the default): every block is refetched.
                         Ignored for a model with tiled leaves
    frozen_storage       how the blocks' frozen 2-D and 3-D weights (a LoRA model's base linears and
                         stacked experts) are stored
                         on their tier: "bf16" (the default: the 16-bit parameter copy), "int8"
                         (linear absmax codes, blocks of 64: 1.06 bytes a weight) or "nf4" (QLoRA's
                         4-bit NormalFloat, blocks of 64: 0.56 bytes a weight); written once at init
                         (or by ``checkpoints.from_hf``) from the 16-bit values, dequantized to the
                         compute dtype at each fetch (``zinf_fn.formats.codebook``,
                         ``zinf_fn.formats.frozen``). Norms, biases, the embedding, the head and
                         tiled weights stay 16-bit; a weight's size must be a multiple of 64
    """

    offload_params: str = "none"
    offload_optimizer: str = "none"
    nvme_path: str | None = None
    param_dtype: torch.dtype = torch.bfloat16
    compute_dtype: torch.dtype | None = None
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    prefetch_depth: int = 1
    update_workers: int = 1
    device: str | None = None
    offload_activations: str = "none"
    trace: str | None = None
    partition: str = "allgather"
    collective_timeout_s: float = 300.0
    staging_buffers: int = 0
    nvme_engine: str = "direct"
    host_memory_budget: int | None = None
    device_memory_budget: int | None = None
    spill_params: str | None = None
    spill_optimizer: str | None = None
    optimizer_piece_bytes: int = 16 << 20
    host_mmap_threshold: int | None = None
    master: str = "fp32"
    param_rounding: str | None = None
    keep_activations: int = 0
    keep_tiles: int = 0
    reuse_blocks: int = 0
    frozen_storage: str = "bf16"

    def __post_init__(self):
        for name in ("offload_params", "offload_optimizer", "offload_activations"):
            allowed = PLACEMENTS if name == "offload_activations" else (*PLACEMENTS, "auto")
            check_choice(f"Config.{name}", getattr(self, name), allowed, "a placement")
        self._check_spills()
        check_choice(
            "Config.frozen_storage",
            self.frozen_storage,
            FROZEN_STORAGES,
            "a frozen weights' storage",
            ", e.g. Config(frozen_storage='nf4') for a QLoRA base",
        )
        if self.uses_nvme() and not self.nvme_path:
            raise ValueError(
                "Config: a placement is 'nvme' but nvme_path is not set; pass "
                "nvme_path='/path/to/dir'"
            )
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"Config.grad_accum must be an int >= 1, got {self.grad_accum!r}")
        for name in (
            "prefetch_depth",
            "update_workers",
            "staging_buffers",
            "keep_activations",
            "keep_tiles",
            "reuse_blocks",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"Config.{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(
                f"Config.clip_grad_norm must be > 0 or None, got {self.clip_grad_norm!r}"
            )
        if not self.collective_timeout_s > 0:
            raise ValueError(
                "Config.collective_timeout_s must be > 0 seconds, got "
                f"{self.collective_timeout_s!r}"
            )
        if self.nvme_engine not in NVME_ENGINES:
            raise ValueError(
                f"Config.nvme_engine must be one of {NVME_ENGINES}, got {self.nvme_engine!r}"
            )
        piece = self.optimizer_piece_bytes
        if (
            not isinstance(piece, int)
            or isinstance(piece, bool)
            or piece <= 0
            or piece % odirect.ALIGN
        ):
            raise ValueError(
                "Config.optimizer_piece_bytes must be a positive multiple of the O_DIRECT "
                "alignment "
                f"{odirect.ALIGN} bytes (e.g. {16 << 20} for 16 MiB), got {piece!r}"
            )
        mmap = self.host_mmap_threshold
        if mmap is not None and (
            not isinstance(mmap, int) or isinstance(mmap, bool) or not 0 <= mmap < 1 << 31
        ):
            raise ValueError(
                f"Config.host_mmap_threshold must be None (auto), 0 (leave malloc alone) or bytes "
                f"below 2**31 (mallopt takes an int), got {mmap!r}"
            )
        if self.partition not in ("allgather", "broadcast"):
            raise ValueError(
                f"Config.partition must be 'allgather' or 'broadcast', got {self.partition!r}"
            )
        self._check_master()
        for name in ("param_dtype", "compute_dtype"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, torch.dtype) or not value.is_floating_point
            ):
                raise TypeError(f"Config.{name} must be a floating torch.dtype, got {value!r}")

    def _check_master(self) -> None:
        check_choice(
            "Config.master",
            self.master,
            MASTERS,
            "a master format",
            ", e.g. Config(master='remainder', param_dtype=torch.bfloat16)",
        )
        if self.master == "remainder" and self.param_dtype != torch.bfloat16:
            raise ValueError(
                "Config.master='remainder' needs param_dtype=torch.bfloat16 (the master is the "
                "bf16 "
                f"copy plus a 16-bit remainder), got param_dtype={self.param_dtype}; "
                "pass "
                f"param_dtype=torch.bfloat16, or master='fp32'"
            )
        self._check_rounding()

    def _check_rounding(self) -> None:
        check_choice("Config.param_rounding", self.param_rounding, (None, *ROUNDINGS), "a rounding")
        if self.master == "remainder" and self.param_rounding == "nearest_even":
            raise ValueError(
                "Config.param_rounding='nearest_even' with master='remainder': a 16-bit remainder "
                "rebuilds the master only from a copy rounded ties away; pass "
                "param_rounding=None "
                "(or 'ties_away')"
            )
        if self.param_rounding == "ties_away" and self.param_dtype != torch.bfloat16:
            raise ValueError(
                "Config.param_rounding='ties_away' rounds to bf16; got "
                f"param_dtype={self.param_dtype}; "
                f"pass param_dtype=torch.bfloat16, or param_rounding=None"
            )

    def resolved_param_rounding(self) -> str:
        """The rounding of the bf16 copy: ``param_rounding``, or its default for ``master``."""
        if self.param_rounding is not None:
            return self.param_rounding
        return "ties_away" if self.master == "remainder" else "nearest_even"

    def uses_nvme(self) -> bool:
        """Whether any state kind (or a spilled part of one) lives on NVMe."""
        spills = (spill_of(self, k)[1] for k in ("params", "optimizer") if spill_of(self, k))
        return "nvme" in (
            self.offload_params,
            self.offload_optimizer,
            self.offload_activations,
            *spills,
        )

    def resolved_mmap_threshold(self) -> int:
        """``host_mmap_threshold``, None resolved: 1 MiB where a state kind is on NVMe (host memory
        is the point), else 0 (malloc's own sliding threshold, which reuses its heap and spares page
        faults)."""
        if self.host_mmap_threshold is not None:
            return self.host_mmap_threshold
        return 1 << 20 if self.uses_nvme() else 0

    def _check_spills(self) -> None:
        """The budgets are byte counts; a spill names a slower tier than its placement; "auto" has a
        budget."""
        for name in ("host_memory_budget", "device_memory_budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(
                    f"Config.{name} must be a number of bytes (an int >= 0) or None, got {value!r}"
                )
        for kind in ("params", "optimizer"):
            placement, spill = self.placement(kind), spill_of(self, kind)
            if placement == "auto" and spill is not None:
                raise ValueError(
                    f"Config.spill_{kind}={getattr(self, f'spill_{kind}')!r} with offload_{kind}="
                    f"'auto': auto chooses the split itself; set one of the two"
                )
            if spill is not None and self.partition != "allgather":
                raise ValueError(
                    f"Config.spill_{kind} needs partition='allgather', got {self.partition!r}"
                )
        if (
            self.spill_optimizer is not None
            and self.offload_optimizer == "none"
            and self.resolved_device().type == "cuda"
        ):
            raise ValueError(
                f"Config.spill_optimizer={self.spill_optimizer!r} with offload_optimizer='none' on "
                "CUDA: the optimizer's rows must share one device; spill from host "
                "memory, e.g. "
                "offload_optimizer='cpu', spill_optimizer='3:nvme'"
            )
        if self.offload_optimizer == "auto" and self.host_memory_budget is None:
            raise ValueError(
                "Config(offload_optimizer='auto') needs host_memory_budget (bytes of RAM to fill "
                "before spilling to NVMe), e.g. host_memory_budget=20 * 2**30"
            )
        if (
            self.offload_params == "auto"
            and self.host_memory_budget is None
            and self.device_memory_budget is None
        ):
            raise ValueError(
                "Config(offload_params='auto') needs device_memory_budget (CUDA) or "
                "host_memory_budget (CPU compute): the bytes to fill before spilling"
            )

    def placement(self, kind: str) -> str:
        """Where ``kind``'s ("params" or "optimizer") rows live: ``offload_<kind>``."""
        return getattr(self, f"offload_{kind}")

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            # "cuda" -> cuda:<current>: the device tensors report
            return canonical_device(self.device)
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    def resolved_compute_dtype(self) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32

    def describe(self) -> dict:
        """JSON-able fields (dtypes as strings), for fingerprints and manifests."""
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, torch.dtype):
                out[k] = str(v).removeprefix("torch.")
        return out


def spill_of(config: Config, kind: str) -> tuple[int, str] | None:
    """``Config.spill_<kind>`` ("params" or "optimizer") parsed: (first spilled unit, placement), or
    None.

    Raises ValueError naming the field when it is not "<k>:<placement>" with k >= 0 and a placement
    slower than ``offload_<kind>`` (order: none, cpu, nvme).
    """
    value = getattr(config, f"spill_{kind}")
    if value is None:
        return None
    first, _, placement = str(value).partition(":")
    base = config.placement(kind)
    slower = PLACEMENTS[PLACEMENTS.index(base) + 1 :] if base in PLACEMENTS else PLACEMENTS
    if not first.isdigit() or placement not in slower:
        raise ValueError(
            f"Config.spill_{kind}={value!r}: expected '<k>:<placement>', k the first unit whose "
            f"rows spill and <placement> one of {slower} (slower than "
            f"offload_{kind}={base!r}), "
            f"e.g. spill_{kind}='3:{slower[-1] if slower else 'nvme'}'"
        )
    return int(first), placement

"""The hook-free runtime: forward scan, recorded blocks, reverse scan, leaf gradients."""

from .blocks import block_forward, block_record, block_vjp, check_carry, check_loss, embed_vjp, head_vjp
from .grads import LeafGrads, accumulate_
from .loops import ScanIO, ScanOptions, backward_scan, forward_scan, head_step
from .tape import Tape, pull_back

__all__ = ["LeafGrads", "ScanIO", "ScanOptions", "Tape", "accumulate_", "backward_scan",
           "block_forward", "block_record", "block_vjp", "check_carry", "check_loss", "embed_vjp",
           "forward_scan", "head_step", "head_vjp", "pull_back"]

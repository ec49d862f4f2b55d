"""zinf_data: fine-tuning data for zinf-fn: the model's tokenizer, chat / instruction / text
formats, loss masks, a memory-mapped token cache, packed or padded batches. Outside the engine: it
makes batches of tensors ``{"inputs", "targets" (-100 where nothing is learned), "segments"?}`` and
nothing else."""

from .batches import IGNORE, TOO_LONG, Batches, held_out, spans
from .cache import Tokenized, tokenized
from .formats import FORMATS, DataError, Fields, Where, read_records
from .tokenizer import encode, load_tokenizer, tokenizer_hash

__all__ = [
    "FORMATS",
    "IGNORE",
    "TOO_LONG",
    "Batches",
    "DataError",
    "Fields",
    "Tokenized",
    "Where",
    "encode",
    "held_out",
    "load_tokenizer",
    "read_records",
    "spans",
    "tokenized",
    "tokenizer_hash",
]

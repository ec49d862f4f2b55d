"""How values are stored: block-wise quantization on a code book (``codebook``: int8 moments, frozen
int8 / NF4 weights) and which leaves are frozen and how they are stored (``frozen``)."""

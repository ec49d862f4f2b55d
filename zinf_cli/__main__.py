"""``python -m zinf_cli ...`` is ``zinf-fn ...`` (e.g. under ``torchrun -m zinf_cli finetune``)."""

import sys

from .main import main

sys.exit(main())

"""`python -m torchtitan_speechlm.demo` (what `make demo` runs): see run.py."""

import sys

from torchtitan_speechlm.demo.run import main

sys.exit(main())

from __future__ import annotations

from qwen4090.commandline.cli import main

raise SystemExit(main())

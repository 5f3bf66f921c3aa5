from __future__ import annotations

from qwen4090.cli import main

raise SystemExit(main())

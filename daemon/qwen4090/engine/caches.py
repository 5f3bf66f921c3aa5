"""Where vLLM's compile caches go: one cache root per instance, kept across restarts/upgrades.

The unit sets ``VLLM_CACHE_ROOT`` to its ``CacheDirectory=`` (/var/cache/qwen4090, or
/var/cache/qwen4090/%i per instance), which systemd keeps across restarts and package
upgrades (postrm removes it only on purge).  vLLM puts torch.compile's artifacts there and,
while it compiles, points Inductor and Triton at ``<root>/torch_compile_cache/<hash>/``
(vLLM 0.26 compilation/compiler_interface.py initialize_cache).  Kernels JIT-compiled outside
torch.compile (``--enforce-eager``, or before the compile cache is set up) would otherwise go
to Triton's default ``~/.triton/cache`` (the state directory, as HOME=/var/lib/qwen4090) and
Inductor's default ``/tmp/torchinductor_<user>`` (lost at every service restart under
``PrivateTmp=yes``).  :func:`cache_environment` sends them to the same cache root.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def cache_root(env: Mapping[str, str]) -> str | None:
    """VLLM_CACHE_ROOT, else systemd's $CACHE_DIRECTORY (the first one), else None."""
    root = env.get("VLLM_CACHE_ROOT") or env.get("CACHE_DIRECTORY", "").split(":")[0]
    return root or None


def cache_environment(env: Mapping[str, str], configured: Mapping[str, str] | None = None
                      ) -> dict[str, str]:
    """The parent environment with the cache variables defaulted under the cache root.

    ``configured`` is the config's ``[vllm.env]``: a VLLM_CACHE_ROOT there is the root, and
    what it sets itself is left to it (it is applied after this and wins).
    """
    out = dict(env)
    configured = configured or {}
    root = cache_root({**env, **configured})
    if root is None:
        return out  # not under systemd and nothing configured: vLLM's own defaults
    for name, value in (("VLLM_CACHE_ROOT", root),
                        ("TRITON_CACHE_DIR", os.path.join(root, "triton")),
                        ("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))):
        if name not in configured:
            out.setdefault(name, value)
    return out

"""What a reload may change, and what it restarts (issue 29.5): pure decisions on the old and
the new config; the supervisor's handle_reload reads the file, applies, and acts."""

from __future__ import annotations

from collections.abc import Callable

from qwen4090.launching.launchvalue import Launch, relaunch_changes
from qwen4090.settings.config import Config, ConfigError, refused_keys, value_of


def read(load: Callable[[], Config], old: Config, error: Callable[..., object]
         ) -> tuple[Config | None, str]:
    """The config read again for a reload, or None and why it is refused (said in the
    journal by ``error``, the log's, with the files kept): a broken file, or a key the schema
    refuses."""
    try:
        new = load()
    except ConfigError as e:
        error("reload_refused", error=str(e), keeping=",".join(old.sources))
        return None, f"reload refused: {e}"
    if why := refused(old, new):
        error("reload_refused", error=f"{why} changed: the client port's owner changes "
                                           "only with a restart (systemctl restart qwen4090)",
                  keeping=",".join(old.sources))
        return None, f"reload refused: {why} needs a restart"
    return new, ""


def refused(old: Config, new: Config) -> str:
    """The keys whose change a reload refuses (the schema's REFUSE): the front's own address
    and vLLM's behind it are bound for the daemon's life; the client address only while the
    front holds it (without the front it is vLLM's own: the launch rule restarts it).  "" when
    none changed."""
    return ", ".join(k for k in refused_keys() if value_of(new, k) != value_of(old, k)
                     and (old.front.enabled or not k.startswith("vllm.")))


def relaunch_reason(was: Launch, nxt: Launch, serving: Launch) -> str:
    """The one rule of what a reload restarts: vLLM restarts iff its next launch differs from
    the serving one.  Its command line and environment are compared as the old and the new
    config would launch now (``was``, ``nxt``: the GPU part's resolver), on the same facts
    (learned limits, the KV budget, the GPU, the host's memory of the serving launch), so that
    only the config's change counts; the runtime in vllm.command's venv against the one the
    serving engine started on (``serving``: install-runtime switched it, behind the front a
    blip, issue 20.6), by its version and by its directory (``install-runtime --force`` of the
    same version is a new runtime; reload said "nothing" to it, issue 31.7).  "" when none."""
    if serving.runtime and nxt.runtime and nxt.runtime != serving.runtime:
        return f"vLLM runtime changed: {serving.runtime} -> {nxt.runtime}"
    if serving.runtime_dir and nxt.runtime_dir and nxt.runtime_dir != serving.runtime_dir:
        return (f"vLLM runtime changed: {nxt.runtime or 'vLLM'} now in {nxt.runtime_dir} "
                f"(was {serving.runtime_dir})")
    changes = relaunch_changes(was, nxt)
    return f"vLLM's launch changed: {changes}" if changes else ""

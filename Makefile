# qwen4090 — top-level targets. Each block is owned by one area; keep them separate.

.PHONY: deb system-test

# --- packaging (issue 3): .deb, lintian, systemd checks, nspawn system test ---------------
# make deb          -> dist/qwen4090_<version>_all.deb (build tree under build/deb/)
# make system-test  -> everything in scripts/system-test.sh (root, Debian 12; see docs/packaging.md)
deb:
	sh scripts/build-deb.sh

system-test:
	bash scripts/system-test.sh

# --- core (issue 2): the README's two commands -------------------------------------------
# make demo  -> set up and serve the tiny model on the CPU vLLM under the supervisor
# make test  -> the whole test command (.ci/run runs the same script)
.PHONY: demo test
demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

#!/usr/bin/env bash
# Mutation testing of fedadapt's core with mutmut (a dev extra; docs/reliability.md keeps the
# score and the survivors). The core: the aggregation (FedAvg's per-tensor mean, the LoRA-rank
# strategies, FedBuff), the simulated clock and fleet, the partitioners, checkpoints, the
# record codec; run against the fast tests of those modules.
#
#   bash scripts/mutation.sh [OUT]            # OUT: where the copy and the results go
#   MUTATE="fedadapt/federation/simulation/fleet.py" bash scripts/mutation.sh OUT  # some modules
#   REV=<commit> bash scripts/mutation.sh OUT                            # another commit
#   MUTANTS='fedadapt.federation.simulation.fleet.x*partial_examples__mutmut_*' \
#       MUTATE=... bash scripts/mutation.sh OUT   # only these mutants (mutmut's name globs)
#
# It mutates a clone of the committed tree (HEAD), never the working copy: mutmut rewrites the
# files it mutates, and the fedadapt.strategies / .clients / .conf / .catalogue packages live in
# other folders (setuptools' package-dir), so the clone gets them copied into fedadapt/ where
# mutmut's copy can import them. Writes OUT/results.txt (every mutant and its status) and
# OUT/score.txt (killed / all, and the survivors). Hours of CPU on 2 cores: run it when the core
# changes, not in CI.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${1:-}" ]; then mkdir -p "$1"; out=$(cd "$1" && pwd); else out=$(mktemp -d); fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0
CORE=${MUTATE:-"fedadapt/strategies/fedavg.py fedadapt/strategies/lora_rank.py
fedadapt/strategies/hetlora.py fedadapt/strategies/flexlora.py fedadapt/strategies/flora.py
fedadapt/strategies/fedsa_lora.py fedadapt/strategies/fedex_lora.py
fedadapt/strategies/fedbuff.py fedadapt/strategies/fednova.py fedadapt/federation/simulation/fleet.py
fedadapt/data/partition.py
fedadapt/federation/server/checkpoint.py fedadapt/federation/wire/records.py fedadapt/codec.py"}
TESTS=${MUTATION_TESTS:-"tests/test_strategies.py tests/test_lora_het.py tests/test_fleet.py
tests/test_partitioners.py tests/test_partition_cache.py tests/test_checkpoint.py
tests/test_resume.py tests/test_properties.py tests/test_grid.py tests/test_flower_equivalence.py
tests/test_hot_path.py tests/test_async_strategy.py tests/test_fednova.py tests/test_codec.py
tests/test_aggregation_edges.py"}

tree="$out/tree"
rm -rf "$tree"
git clone -q "$repo" "$tree"
cd "$tree"
git checkout -q "${REV:-HEAD}"  # REV=<commit>: another committed state
git log -1 --format="mutation: fedadapt %H" | tee "$out/commit.txt"
for pair in strategies:strategies clients:clients conf:conf catalogue:datasets; do
  rm -rf "fedadapt/${pair%%:*}"
  cp -r "${pair#*:}" "fedadapt/${pair%%:*}"
done
# mutmut reads [tool.mutmut] from pyproject.toml when there is one, else setup.cfg
python - "$CORE" "$TESTS" <<'EOF'
import sys
core, tests = sys.argv[1].split(), sys.argv[2].split()
lines = ["", "[tool.mutmut]", 'source_paths = ["fedadapt"]',
         f"only_mutate = {core!r}", 'also_copy = ["tests", "datasets", "conf", "scripts"]',
         'pytest_add_cli_args = ["-m", "not slow", "-q", "-p", "no:warnings"]',
         f"pytest_add_cli_args_test_selection = {tests!r}", "max_children = 2", ""]
open("pyproject.toml", "a").write("\n".join(lines).replace("'", '"'))
EOF
# mutmut runs the tests once in its own process, then forks a child per mutant: an OpenMP pool
# of several threads made in the parent does not survive the fork (the children segfaulted in
# whole-run tests), so torch keeps one thread here (this clone's tests only)
cat >> tests/conftest.py <<'PY'


import torch as _torch  # noqa: E402  (scripts/mutation.sh: one OpenMP thread, fork-safe)

_torch.set_num_threads(1)
_torch.set_num_threads = lambda n: None
PY
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export FEDADAPT_CACHE="$out/cache"
set -f  # MUTANTS: globs that mutmut matches (fnmatch), not the shell
# shellcheck disable=SC2086
python -m mutmut run ${MUTANTS:-} 2>&1 | tail -n 40 | tee "$out/run.log" || true
set +f
python -m mutmut results --all true > "$out/results.txt" 2>&1 || python -m mutmut results > "$out/results.txt" 2>&1
python - "$out" <<'EOF'
import collections, re, sys
out = sys.argv[1]
status = {}
for line in open(f"{out}/results.txt"):
    m = re.match(r"\s*(\S+): (\w[\w ]*)$", line.rstrip())
    if m:
        status[m.group(1)] = m.group(2).strip()
counts = collections.Counter(status.values())
killed = counts.get("killed", 0) + counts.get("timeout", 0)
total = sum(counts.values())
lines = [f"mutants: {total}; killed {killed} ({100 * killed / max(total, 1):.1f}%); "
         + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))]
lines += [f"  {name}: {s}" for name, s in sorted(status.items())
          if s not in ("killed", "timeout")]
open(f"{out}/score.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines[:1]))
print(f"survivors and others: {out}/score.txt; one mutant's diff: "
      f"cd {out}/tree && python -m mutmut show NAME")
EOF

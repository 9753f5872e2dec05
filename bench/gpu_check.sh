#!/usr/bin/env bash
# The CUDA checks, in one run (under 12 minutes on one GPU):
#   1. async vs sync on CUDA: an async run interrupted at step 27 and resumed (mode auto =
#      async on CUDA) must equal an uninterrupted sync run, field by field (compare.py);
#      the same with --amp (fp16 autocast + GradScaler state);
#   2. device-to-host staging bandwidth, pinned vs pageable memory;
#   3. async_blocking_s for a multi-GB state (AsyncCheckpointer on CUDA) next to sync_save_s;
#   4. loop throughput with no / sync / async recovery saves (bench/loop_overhead.py);
#   5. the multi-process path on one GPU (bench/scale_out_bench.py): `torchrun --nproc_per_node 1`
#      and one process, blocked time per save async vs sync (goal <= 2%) and throughput with
#      async saves vs none (goal >= 97%), local disk and a SeaweedFS store.
# Writes OUTDIR/summary.json and OUTDIR/gpu_check.log. Exit 0 when every check passed,
# 1 when one failed, 69 (EX_UNAVAILABLE) when no CUDA device is visible, 2 on usage.
#
#   bash bench/gpu_check.sh OUTDIR        # PYTHON=... to choose the interpreter
#   STATE_MB=4096 (multi-GB state size), SCALE_MB=1024 (state of the torchrun runs),
#   WORK=... (scratch folder, default OUTDIR/work)
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash bench/gpu_check.sh OUTDIR" >&2
    exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "gpu_check: cannot create $1" >&2; exit 2; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
STATE_MB=${STATE_MB:-4096}
SCALE_MB=${SCALE_MB:-1024}
WORK=${WORK:-$OUT/work}
LOG=$OUT/gpu_check.log
PARTS=$OUT/parts
rm -rf "$WORK" "$PARTS"
mkdir -p "$WORK" "$PARTS"
: > "$LOG"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
# run NAME TIMEOUT EXPECTED_EXIT CMD...: runs CMD with output appended to the log and
# records {"name", "ok", "exit", "seconds"} in PARTS/NAME.status.json.
run() {
    local name=$1 limit=$2 expect=$3; shift 3
    log "== $name: $*"
    local started=$SECONDS
    timeout "$limit" "$@" >>"$LOG" 2>&1
    local code=$?
    local ok=false
    [ "$code" -eq "$expect" ] && ok=true
    printf '{"name": "%s", "ok": %s, "exit": %d, "expected_exit": %d, "seconds": %d}\n' \
        "$name" "$ok" "$code" "$expect" "$((SECONDS - started))" > "$PARTS/$name.status.json"
    log "   $name: exit $code (wanted $expect) in $((SECONDS - started))s"
    [ "$ok" = true ]
}

log "gpu_check in $OUT (repo $REPO, python $PY)"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >>"$LOG" 2>&1; then
    log "no CUDA device visible to $PY: nothing to check"
    printf '{"cuda": false, "ok": false, "reason": "no CUDA device visible"}\n' > "$OUT/summary.json"
    exit 69
fi
"$PY" - >"$PARTS/environment.json" 2>>"$LOG" <<'EOF'
import json, platform, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                  "gpu": torch.cuda.get_device_name(0),
                  "gpu_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)}))
EOF

# --- 1. async interrupted + resumed == sync uninterrupted, on CUDA -----------------------
T=trainer
run sync_baseline 120 0 "$PY" -m $T --output "$WORK/sync" --device cuda --checkpoint-mode sync
run async_interrupted 120 75 "$PY" -m $T --output "$WORK/async" --device cuda --checkpoint-mode async \
    --interrupt-at-step 27
run async_resumed_auto 120 0 "$PY" -m $T --output "$WORK/async" --device cuda --checkpoint-mode auto --resume
run compare_async_vs_sync 120 0 "$PY" compare.py "$WORK/sync/checkpoints/step-00000064" \
    "$WORK/async/checkpoints/step-00000064"
run amp_sync_baseline 120 0 "$PY" -m $T --output "$WORK/amp-sync" --device cuda --amp --checkpoint-mode sync
run amp_async_interrupted 120 75 "$PY" -m $T --output "$WORK/amp-async" --device cuda --amp \
    --checkpoint-mode async --recover-every-steps 5 --interrupt-at-step 23
run amp_async_resumed 120 0 "$PY" -m $T --output "$WORK/amp-async" --device cuda --amp \
    --checkpoint-mode async --recover-every-steps 5 --resume
run compare_amp_async_vs_sync 120 0 "$PY" compare.py "$WORK/amp-sync/checkpoints/step-00000064" \
    "$WORK/amp-async/checkpoints/step-00000064"
run attempt_modes 60 0 "$PY" - "$WORK" "$PARTS/attempt_modes.json" <<'EOF'
import json, sys
from pathlib import Path
work, target = Path(sys.argv[1]), Path(sys.argv[2])
modes = {run: [json.loads(p.read_text())["checkpoint_mode"] for p in sorted((work / run / "attempts").glob("*/attempt.json"))]
         for run in ("sync", "async", "amp-async")}
target.write_text(json.dumps(modes) + "\n")
print(modes)
# auto on CUDA must have chosen async
sys.exit(0 if modes["async"] == ["async", "async"] and modes["sync"] == ["sync"] else 1)
EOF

# --- 2. device-to-host staging bandwidth: pinned vs pageable ------------------------------
run d2h_bandwidth 180 0 "$PY" - "$PARTS/d2h.json" <<'EOF'
import json, statistics, sys, time
import torch
size = 2 << 30  # 2 GiB
source = torch.empty(size, dtype=torch.uint8, device="cuda").random_(0, 255)
result = {"bytes": size}
for kind in ("pageable", "pinned"):
    target = torch.empty(size, dtype=torch.uint8, pin_memory=(kind == "pinned"))
    target.copy_(source)  # first touch / warm-up
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source, non_blocking=(kind == "pinned"))
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - started)
    result[f"{kind}_gbps"] = round(size / statistics.median(runs) / 1e9, 2)
    del target
result["pinned_over_pageable"] = round(result["pinned_gbps"] / result["pageable_gbps"], 2)
json.dump(result, open(sys.argv[1], "w"))
print(result)
EOF

# --- 3. async_blocking_s for a multi-GB state ---------------------------------------------
run async_blocking_multi_gb 300 0 "$PY" - "$PARTS/async_multi_gb.json" "$STATE_MB" "$WORK/multi-gb" <<'EOF'
import json, shutil, statistics, sys, time, warnings
from pathlib import Path
import torch
sys.path.insert(0, "bench")
warnings.filterwarnings("ignore")
from common import facts_for, state_bytes, train_step, training_state
from trainer.checkpoint.checkpointer import AsyncCheckpointer, SyncCheckpointer
from trainer.checkpoint.commit import RenameCommit
from trainer.checkpoint.section import LocalSection

target, size_mb, work = Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
state, workload = training_state(size_mb, device)
nbytes = state_bytes(state)
result = {"state_gb": round(nbytes / 1e9, 2)}

store = LocalSection(work / "sync")
started = time.perf_counter()
SyncCheckpointer(RenameCommit(store), "gpu-check").save(state.state_dict(), facts_for(1))
result["sync_save_s"] = round(time.perf_counter() - started, 3)
shutil.rmtree(work / "sync")

store = LocalSection(work / "async")
checkpointer = AsyncCheckpointer(RenameCommit(store), "gpu-check", device)
saves, committed = [], []
for step in range(1, 6):
    train_step(state, workload, device)  # the save follows an optimizer step, as in the loop
    began = time.perf_counter()
    committed += checkpointer.save(state.state_dict(), facts_for(step))  # the previous one, committed
    called = time.perf_counter()
    checkpointer.wait_for_staging()
    staged = time.perf_counter()
    saves.append({"save_call_s": called - began, "blocking_s": staged - began})
pinned = bool(checkpointer.stager.buffers) and all(b.is_pinned() for b in checkpointer.stager.buffers)
committed += checkpointer.finalize()
steady = saves[2:]  # the first allocates the buffers
result.update({
    "first_save_blocking_s": round(saves[0]["blocking_s"], 4),
    "async_save_call_s": round(statistics.median(s["save_call_s"] for s in steady), 4),
    "async_blocking_s": round(statistics.median(s["blocking_s"] for s in steady), 4),
    "async_total_s": round(statistics.median(p.save_s for p in committed[1:]), 3),
    "staging_gbps": round(nbytes / statistics.median(s["blocking_s"] for s in steady) / 1e9, 2),
    "staging_buffers_pinned": pinned,
})
result["async_blocking_over_sync"] = round(result["async_blocking_s"] / result["sync_save_s"], 4)
result["async_save_call_over_sync"] = round(result["async_save_call_s"] / result["sync_save_s"], 5)
json.dump(result, open(target, "w"))
print(result)
shutil.rmtree(work, ignore_errors=True)
sys.exit(0 if pinned or device.type == "cpu" else 1)
EOF

# --- 4. loop throughput, no / sync / async saves ------------------------------------------
run loop_overhead 180 0 "$PY" bench/loop_overhead.py --device cuda --size-mb 1024 --steps 60 --every 20 \
    --dir "$WORK" --json "$PARTS/loop_overhead.json"

# --- 5. the multi-process path on one GPU: torchrun --nproc_per_node 1, next to one process --
# Blocked time per save (async staging into pinned memory vs a sync save) and steps per second
# with async saves vs with none, through the real CLI, locally and in a SeaweedFS store.
run scale_out_torchrun 420 0 "$PY" bench/scale_out_bench.py --nproc 1 --size-mb "$SCALE_MB" \
    --saves 4 --every 10 --with-none --dir "$WORK" --json "$PARTS/scale_out_torchrun.json"
run scale_out_single 420 0 "$PY" bench/scale_out_bench.py --nproc 1 --no-torchrun --size-mb "$SCALE_MB" \
    --saves 4 --every 10 --with-none --local-only --dir "$WORK" --json "$PARTS/scale_out_single.json"

# --- summary ------------------------------------------------------------------------------
"$PY" - "$PARTS" "$OUT/summary.json" <<'EOF' 2>>"$LOG" | tee -a "$LOG"
import json, sys
from pathlib import Path
parts, target = Path(sys.argv[1]), Path(sys.argv[2])
summary = {"cuda": True, "checks": {}}
for path in sorted(parts.glob("*.status.json")):
    status = json.loads(path.read_text())
    summary["checks"][status.pop("name")] = status
for name in ("environment", "attempt_modes", "d2h", "async_multi_gb", "loop_overhead", "scale_out_torchrun",
             "scale_out_single"):
    path = parts / f"{name}.json"
    summary[name] = json.loads(path.read_text()) if path.exists() else None
summary["ok"] = all(c["ok"] for c in summary["checks"].values())
target.write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
rm -rf "$WORK"
log "summary: $OUT/summary.json"
"$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$OUT/summary.json"

#!/usr/bin/env bash
# A probe, not a benchmark of record: where a 1 GB FP8 bench export --fp8 --like --device cuda spends its time on
# the GPU machine (RESULTS.md, eighth session). Variants of one export (default, --read-threads 0 / 4, a 0.5 ms
# switch interval, no background flush, tensors made into bytes on the reader threads), then py-spy profiles
# (carry a static py-spy binary as bench-data/probe/py-spy). SIZE=0.05GB DEV=cpu: a dry run on a CPU host.
# Everything comes back as one archive, $OUT/probe.tgz (the device returns only so many files).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh && link_packages /tmp/glmconv-cli "$PWD"
export PYTHONPATH=/tmp/site:/tmp/site-z3:$PWD:/tmp/glmconv-cli PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONUNBUFFERED=1
W=/tmp/probe; R=/tmp/probe-results; mkdir -p $W $R
{ sysctl vm.dirty_ratio vm.dirty_background_ratio vm.dirty_bytes vm.dirty_background_bytes vm.dirty_expire_centisecs; grep -E "MemFree|^Cached|Dirty|Writeback:" /proc/meminfo; df -T /tmp; mount | grep " /tmp \| / "; cat /proc/sys/kernel/yama/ptrace_scope; } > $R/env.txt 2>&1
python3 -m glmconv fixture make $W/b --preset bench --size ${SIZE:-1GB} --fp8 --force > $R/make.txt 2>&1
python3 -m glmconv convert $W/b $W/mc --device ${DEV:-cuda} --json > $R/convert.json 2>&1
cat > $W/run.py <<'P'
import os, sys, runpy
mode = sys.argv[1]
if mode == "si":
    sys.setswitchinterval(0.0005)
if mode == "pre":  # tensors made into byte arrays on the reader threads: the writer only pwrites
    import torch
    import glmconv.runners.backward as B, glmconv.io.safetensors.writer as W
    orig = B._encoded
    class Pre:
        def __init__(s, t): s.t = t; s.a = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        def numel(s): return s.a.nbytes
        def element_size(s): return 1
    B._encoded = lambda *a, **k: [(n, Pre(t)) for n, t in orig(*a, **k)]
    ow = W.PlannedShardWriter.write
    def write(self, name, tensor):
        if not isinstance(tensor, Pre):
            return ow(self, name, tensor)
        t = self._expect(name)
        W._pwrite_all(self._fd_for(t), tensor.a.data.cast("B"), self._offsets[name]); self._done(t, tensor.a.nbytes)
    W.PlannedShardWriter.write = write
if mode == "nosync":
    import glmconv.io.safetensors.writer as W
    init = W.PlannedShardWriter.__init__
    W.PlannedShardWriter.__init__ = lambda self, *a, sync=False, **k: init(self, *a, sync=False, **k)
sys.argv = ["glmconv", "export", sys.argv[2], sys.argv[3], "--like", sys.argv[4], "--fp8", "--device", os.environ.get("DEV", "cuda"), "--json"] + sys.argv[5:]
runpy.run_module("glmconv", run_name="__main__")
P
ex() {  # ex NAME MODE [extra args]
  local n=$1 m=$2; shift 2; rm -rf $W/ex; sync
  /usr/bin/time -f "$n wall %e s" -a -o $R/times.txt python3 $W/run.py $m $W/mc $W/ex $W/b "$@" > $R/$n.json 2>&1
  for f in $W/b/*.safetensors; do cmp -s $f $W/ex/$(basename $f) || echo "$n DIFF $f" >> $R/times.txt; done
}
ex default plain; ex default2 plain; ex serial plain --read-threads 0; ex si si; ex nosync nosync; ex pre pre; ex t4 plain --read-threads 4; ex pre-t4 pre --read-threads 4
rm -rf $W/ex; sync
${PYSPY:-bench-data/probe/py-spy} record -o $R/spy.txt -f raw -r 250 --threads -- python3 $W/run.py plain $W/mc $W/ex $W/b > $R/spy-run.json 2> $R/spy-err.txt
rm -rf $W/ex; sync
${PYSPY:-bench-data/probe/py-spy} record -o $R/spy-gil.txt -f raw -r 250 --threads --gil -- python3 $W/run.py plain $W/mc $W/ex $W/b > $R/spy-gil-run.json 2>> $R/spy-err.txt
rm -rf $W/ex; sync
${PYSPY:-bench-data/probe/py-spy} record -o $R/spy-native.txt -f raw -r 250 --threads --native -- python3 $W/run.py plain $W/mc $W/ex $W/b > $R/spy-native-run.json 2>> $R/spy-err.txt
python3 - <<'S' > $R/phases.txt 2>&1
import json, glob, os
for f in sorted(glob.glob("/tmp/probe-results/*.json")):
    try:
        text = open(f).read()
        d = json.loads(text[text.index("{"):text.rindex("}") + 1])
        print(os.path.basename(f), d.get("phases"), d.get("busy"))
    except Exception as e:
        print(f, "unreadable", e)
S
cat $R/times.txt $R/phases.txt; tail -3 $R/spy-err.txt
tar -czf "$OUT/probe.tgz" -C $R .

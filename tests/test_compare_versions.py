"""scripts/compare_versions.py: the summary's ratios are of the medians over prompts, texts are compared prompt by
prompt, and a batch kind the baseline lacks has no ratio."""
from scripts import compare_versions


def run(tokens_per_s: float, decode: float, out: list) -> dict:
    return {"tokens": len(out), "tokens_per_s": tokens_per_s, "decode_tokens_per_s": decode, "out": out}


def test_summary_takes_ratios_of_medians_and_counts_equal_texts():
    result = {
        "machine": {"processor": "AMD EPYC", "cpu_family": "family 25 model 17", "isa": "avx512-bf16"},
        "code": {"commit": "d177de5abc"}, "baseline": "e433e46", "questions": [81, 82, 83],
        "args": {"precision": "int4", "max_new_tokens": "256"},
        "single": {"vanilla": {
            "baseline": [run(60.0, 70.0, [1, 2]), run(50.0, 60.0, [3]), run(90.0, 95.0, [4])],
            "this": [run(66.0, 72.0, [1, 2]), run(10.0, 11.0, [3, 5]), run(99.0, 99.0, [4])]}},
        "batches": {"vanilla B=8 default": {"baseline": [{"tokens_per_s": 100.0}], "this": [{"tokens_per_s": 134.0}]},
                    "vanilla B=8 frozen": {"this": [{"tokens_per_s": 125.8}]}},
    }
    lines = compare_versions.summarize(result).splitlines()
    assert lines[0] == "# This checkout (d177de5) against e433e46"
    assert "(CPU family 25 model 17, avx512-bf16)" in lines[2] and "3 MT-bench first turns" in lines[2]
    # medians 60 -> 66 (tokens/s) and 70 -> 72 (decode): one slow prompt does not move them; 2 of 3 texts equal
    assert "| vanilla | 60.0 | 66.0 | 1.100 | 70.0 | 72.0 | 1.029 | 2/3 |" in lines
    assert "| vanilla B=8 default | 100.0 | 134.0 | 1.340 |" in lines
    assert "| vanilla B=8 frozen | - | 125.8 | - |" in lines


def test_summary_without_single_sequences_has_the_batch_table_only():
    """--skip_single: no single-sequence table, the batch table right after the header."""
    result = {"machine": {"processor": "AMD EPYC", "cpu_family": "family 25 model 17", "isa": "avx512-bf16"},
              "code": {"commit": "b8af494abc"}, "baseline": "e433e46", "questions": [81],
              "args": {"precision": "int4", "max_new_tokens": "256"}, "single": {},
              "batches": {"vanilla B=2 default": {"baseline": [{"tokens_per_s": 98.1}], "this": [{"tokens_per_s": 114.4}]}}}
    lines = compare_versions.summarize(result).splitlines()
    assert not any("single sequence" in line for line in lines)
    assert lines[4:] == ["| batch (every prompt, B rows) | baseline tokens/s | this | ratio |", "|---|---|---|---|",
                         "| vanilla B=2 default | 98.1 | 114.4 | 1.166 |"]

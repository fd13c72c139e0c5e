"""Run records beside the checkpoints: trimming a records file at the resume point.

The records' end-to-end behaviour is asserted on the resume scenarios: on S3, a run interrupted
twice, each time on an empty machine, ends with the metrics.jsonl of an uninterrupted run and
`llm plot` reads it from the bucket (tests/e2e/test_resume_s3.py); on one machine, a resume cuts the
lines past the checkpoint (tests/e2e/test_resume.py).
"""

from __future__ import annotations

from llm.run_dir import cut_after


def test_cut_after_keeps_lines_up_to_the_step_and_drops_torn_ones(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"step": 2, "text": "a"}\n{"step": 4, "text": "b"}\n{"step": 6, "te')
    assert cut_after(path, 4) == 2
    assert path.read_text() == '{"step": 2, "text": "a"}\n{"step": 4, "text": "b"}\n'
    assert cut_after(tmp_path / "absent.jsonl", 4) == 0 and not (tmp_path / "absent.jsonl").exists()

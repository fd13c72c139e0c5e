"""Scenario code that the tests and the benchmarks both run: neither imports the other, both import this.

`scenarios.resume`: tiny token shards, a tiny recipe, real `train.py` processes with a recorder
(`scenarios/resume_driver.py`), and the checks that decide "resumed bit-identically".
"""

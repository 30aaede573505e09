"""Every bench's JSON names the CPU it ran on: the machines change between sessions (AVX-512
or not, Intel or AMD), and a run's ratios only compare with runs on the same kind."""

from tessera.bench.harness import cpu_description, machine

MILAN = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx fma avx2 bmi2

processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx fma avx2 bmi2
"""


def test_the_cpu_is_named_with_its_family_model_and_widest_isa():
    assert cpu_description(MILAN) == "AMD EPYC (family 25, model 1; avx2)"
    xeon = MILAN.replace("AMD EPYC", "Intel(R) Xeon(R) Platinum").replace("avx2 bmi2", "avx2 avx512f")
    assert cpu_description(xeon) == "Intel(R) Xeon(R) Platinum (family 25, model 1; avx512f)"
    bare = "model name\t: Some CPU\nflags\t: sse2\n"  # no family/model lines (another kernel's layout)
    assert cpu_description(bare) == "Some CPU (sse2)"


def test_the_machine_facts_of_a_run_carry_the_cpu():
    facts = machine()
    assert isinstance(facts["cpu"], str) and facts["cpu"]
    assert facts["cores"] >= 1

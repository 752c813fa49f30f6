"""The main job streams an answer and writes its summary."""

from exlnb.report import main


def test_main_job_streams_a_chatml_answer_and_writes_a_summary(cpu_session, tmp_path, capsys):
    assert main(["--engine", "cpu", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    summary = (tmp_path / "summary.md").read_text()
    assert "Paris" in printed and "Paris" in summary
    assert "eos: stop_token" in summary

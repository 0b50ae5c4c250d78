"""fedadapt.progress: plain lines without escape codes, the job's methods and estimate, and
Flower's deprecation notice once per process."""

import io
import logging

import pytest

from fedadapt import progress


class Captured:
    def __init__(self, capsys) -> None:
        self.capsys, self.text = capsys, ""

    def getvalue(self) -> str:
        self.text += self.capsys.readouterr().err
        return self.text


@pytest.fixture
def plain(monkeypatch, capsys):
    """Plain mode, standard error captured."""
    monkeypatch.setattr(progress._STATE, "interactive", False)
    monkeypatch.setattr(progress._STATE, "job", None)
    return Captured(capsys)


def test_plain_stream_drops_escape_codes():
    raw = io.StringIO()
    out = progress.PlainStream(raw)
    out.write("\x1b[93mWARNING \x1b[0m: x\n")
    out.write("\x1b]8;;http://a\x1b\\link\x1b]8;;\x1b\\ \x1b[2K\x1b[1Adone\n")
    assert raw.getvalue() == "WARNING : x\nlink done\n"
    assert out.getvalue() == raw.getvalue()  # everything else is the raw stream's


def test_task_lines_every_interval_and_at_the_end(plain, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress.time, "time", lambda: now[0])
    with progress.task("features digits/train", total=1000, unit="images", interval=5) as bar:
        for _ in range(10):
            now[0] += 1.0
            bar.advance(100)
    lines = plain.getvalue().splitlines()
    # the first advance, one after 5 s, and the last (1000/1000): not one per advance
    assert [ln.split(" | ")[0] for ln in lines] == [
        "features digits/train 100/1000 images", "features digits/train 600/1000 images",
        "features digits/train 1000/1000 images"]
    assert "100 images/s" in lines[1] and "~4 s left" in lines[1]
    assert "\x1b" not in plain.getvalue()


def test_unfinished_task_still_says_where_it_stopped(plain):
    with pytest.raises(RuntimeError):
        with progress.task("images x", total=10, interval=60) as bar:
            bar.advance(3)
            bar.advance(3)
            raise RuntimeError("stop")
    assert plain.getvalue().splitlines()[-1].startswith("images x 6/10")


def test_job_counts_methods_and_estimates_the_whole_job(plain, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress.time, "time", lambda: now[0])
    with progress.job("quickstart", {"a": 4, "b": 4, "c": 1}) as job:
        job.start("a")
        with progress.task("[a] round", total=4, interval=0, for_job=True) as bar:
            now[0] += 10.0  # start-up + round 1
            bar.update(completed=1, info="loss 2.000")
            for r in (2, 3, 4):
                now[0] += 1.0
                bar.update(completed=r, info="loss 1.000")
                if r == 2:  # 2 rounds left at 1 s; b: start-up 10 s + 3 rounds; c: 10 s
                    assert job.eta == pytest.approx(2 + 13 + 10)
        job.finish("a")
        assert job.completed == 4 and job.total == 9
        job.start("b")
        job.finish("b", skipped=True)
    text = plain.getvalue()
    assert "[job] method 1/3: a starts" in text
    assert "[a] round 2/4 | loss 1.000 | ~2 s left | job 0/3 methods, ~25 s left" in text
    assert "[job] method 1/3: a done" in text and "[job] method 2/3: b complete already" in text


def test_flowers_noise_is_dropped_and_the_rest_passes():
    progress.quiet_libraries()
    progress.quiet_libraries()  # idempotent
    logger = logging.getLogger("flwr")
    assert sum(isinstance(f, progress._NoiseFilter) for f in logger.filters) == 1
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        from flwr.common.logger import warn_deprecated_feature

        for _ in range(3):
            warn_deprecated_feature("The `run_simulation` function is deprecated ...")
        logger.warning("Manually terminating %s", "ClientAppActor")
        warn_deprecated_feature("something else")
        logger.warning("round 3: dropped 1 of 10 training replies")
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 2 and "something else" in seen[0]  # other notices pass untouched
    assert seen[1] == "round 3: dropped 1 of 10 training replies"


def test_fmt_seconds():
    assert progress.fmt_seconds(None) == "?"
    assert progress.fmt_seconds(42.4) == "42 s"
    assert progress.fmt_seconds(185) == "3 min 05 s"
    assert progress.fmt_seconds(3720) == "1 h 02 min"


def test_tqdms_lock_survives_a_thread_map_in_another_thread(monkeypatch):
    """datasets' thread_map (tqdm's ensure_lock) deletes ``tqdm._lock`` when it finds none; a
    bar closing in another thread then raised "type object 'tqdm' has no attribute '_lock'"
    (a client's handshake failed so, beside an evidence sweep's first run). Once the libraries
    are quieted the lock exists, so ensure_lock puts it back instead of deleting it."""
    from tqdm import tqdm
    from tqdm.contrib.concurrent import ensure_lock

    monkeypatch.setattr(progress, "_QUIETED", [])
    if hasattr(tqdm, "_lock"):
        monkeypatch.delattr(tqdm, "_lock")
    progress.quiet_libraries()

    class Bar(tqdm):  # as datasets' hf_tqdm is
        pass

    with ensure_lock(Bar):  # datasets' thread_map in one thread ...
        bar = Bar(total=1, file=io.StringIO())  # ... its bar made in another meanwhile
    bar.close()  # takes Bar._lock: AttributeError when ensure_lock had deleted it
    assert hasattr(Bar, "_lock")

"""tndebug/cli.py: what any command shows on stderr (issue 12)."""
import torch

from tndebug.cli import main
from tndebug.config import ModelConfig
from tndebug.inject import make_model


def test_the_first_line_of_stderr_is_tndebugs_and_known_noise_is_dropped(capsys, tmp_path):
    path = tmp_path / "m.pt"
    torch.save(make_model(ModelConfig.tiny()).state_dict(), path)
    (tmp_path / "warns.py").write_text(
        "import warnings\n"
        "import torch\n"
        "warnings.warn('user code says hello')\n"
        "def make_model(**kw):\n"
        "    torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2), 1)  # nested-tensor noise\n"
        "    raise RuntimeError('nope')\n")
    code = main(["triage", str(path), "--model", f"{tmp_path}/warns.py:make_model",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].startswith("tndebug: error: "), err
    assert any("UserWarning: user code says hello" in ln for ln in lines[1:]), err
    assert "enable_nested_tensor" not in err

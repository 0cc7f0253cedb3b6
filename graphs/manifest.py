"""``manifest.json``: the one description of an export that the runtime reads.

Written by the exporter, read by :func:`graphs.load`. It names every graph with its full I/O
contract (:mod:`graphs.contract`), the source model's sizes, the drafter and its default tree, the
tool versions, and a sha256 of every file so that a tampered or truncated artifact is caught
before a session is built.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from graphs.contract import FORMAT_VERSION, GraphSpec
from graphs.errors import ArtifactError
from graphs.integrity import sha256_file, verify_files
from graphs.schema import check_manifest

__all__ = ["MANIFEST", "PARTIAL_MARK", "ArtifactError", "Manifest", "sha256_file"]

MANIFEST = "manifest.json"
PARTIAL_MARK = ".specexport-partial"  # marks an export being written (exporter.outdir); never hashed
MAX_MANIFEST_BYTES = 64 << 20


@dataclass
class Manifest:
    """Everything the runtime needs to know about ``out_dir``.

    ``source``: architecture, model_type, num_layers, hidden_size, vocab_size, num_kv_heads,
    head_dim, max_position_embeddings, dtype. ``drafter``: None (base only) or a dict with
    ``kind`` ("medusa" | "eagle") and its sizes and config. ``tree``: the default tree
    (``{"medusa_paths": [...]}`` or ``{"eagle": {"topk", "depth", "total_tokens"}}``).
    ``generation``: eos/bos/pad token ids. ``files``: relative path -> sha256.
    ``optimization``: role -> what ``python -m exporter.optimize`` did to that graph (passes, target
    provider, dtype, quantization); empty for the raw trace.
    """

    source: dict
    graphs: dict[str, GraphSpec]
    drafter: dict | None = None
    tree: dict = field(default_factory=dict)
    generation: dict = field(default_factory=dict)
    tokenizer: str | None = None
    opset: int = 17
    versions: dict = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    validation: dict = field(default_factory=dict)
    optimization: dict[str, dict] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checked: dict = field(default_factory=dict, repr=False, compare=False)  # set by read (not written)

    @property
    def one_sequence(self) -> dict | None:
        """The record of the base's one-sequence graph (``exporter.optimize``: the base's contract,
        each layer's attention one GroupQueryAttention) that the runtime runs for one-token calls
        and one sequence's calls: its ``file``, ``max_columns``, its checks; None where there is none."""
        one = (self.optimization.get("base") or {}).get("one_sequence")
        return one if isinstance(one, dict) else None

    @property
    def one_sequence_file(self) -> str | None:
        return self.one_sequence["file"] if self.one_sequence else None

    @property
    def attention_form(self) -> str | None:
        """Of a base optimized with ``--target cuda``: the attention form the device measured faster
        (``"attention"``: the base for every call; ``"gqa"``: :attr:`one_sequence_file` for the calls
        it takes, the base for batches of trees), or the default where none measured yet
        (``optimization.base.attention_forms``); None for other exports."""
        forms = (self.optimization.get("base") or {}).get("attention_forms")
        return forms.get("chosen") if isinstance(forms, dict) else None

    def to_json(self) -> dict:
        return {
            "format_version": self.format_version,
            "source": self.source,
            "drafter": self.drafter,
            "graphs": {k: g.to_json() for k, g in self.graphs.items()},
            "tree": self.tree,
            "generation": self.generation,
            "tokenizer": self.tokenizer,
            "opset": self.opset,
            "versions": self.versions,
            "validation": self.validation,
            "optimization": self.optimization,
            "files": self.files,
        }

    @classmethod
    def from_json(cls, d: dict) -> Manifest:
        if not isinstance(d, dict):
            raise ArtifactError(f"manifest must be a JSON object, got {type(d).__name__}; re-export the model")
        if d.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"manifest format_version {d.get('format_version')!r} is not supported "
                f"(this runtime reads {FORMAT_VERSION}); re-export with this version of the exporter"
            )
        check_manifest(d)  # types, ranges, paths and sizes: before anything is allocated or opened
        return cls(
            source=d["source"],
            graphs={k: GraphSpec.from_json(g) for k, g in d["graphs"].items()},
            drafter=d.get("drafter"),
            tree=d.get("tree", {}),
            generation=d.get("generation", {}),
            tokenizer=d.get("tokenizer"),
            opset=d.get("opset", 17),
            versions=d.get("versions", {}),
            files=d.get("files", {}),
            validation=d.get("validation", {}),
            optimization=d.get("optimization", {}),
        )

    def write(self, out_dir: Path) -> Path:
        """Hash every file in ``out_dir`` (except the manifest) into ``files`` and write the manifest
        atomically (a temporary file, fsync, rename, fsync of the directory): a reader never sees half
        a manifest, whatever stops the writer."""
        out_dir = Path(out_dir)
        self.files = {
            p.relative_to(out_dir).as_posix(): sha256_file(p)
            for p in sorted(out_dir.rglob("*"))
            if p.is_file() and p.name not in (MANIFEST, PARTIAL_MARK)
        }
        path = out_dir / MANIFEST
        tmp = out_dir / f".{MANIFEST}.tmp-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.to_json(), indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        dfd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return path

    @classmethod
    def read(cls, out_dir: Path, verify=True) -> Manifest:
        """Parse, validate and (``verify``) check ``out_dir`` against its manifest.

        ``verify``: True / "auto" (sha256 of every file, skipped when a proof record of an earlier full
        check still matches: :mod:`graphs.integrity`), "full" (always hash), False / "none" (confinement
        and schema only).
        """
        out_dir = Path(out_dir)
        path = out_dir / MANIFEST
        if not out_dir.is_dir():
            raise ArtifactError(f"{out_dir} is not a directory; pass the out_dir written by exporter.export")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise ArtifactError(
                f"{path} not found; {out_dir} is not an export (run python -m exporter.export)"
            ) from None
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            raise ArtifactError(
                f"{path} is not a regular file of at most {MAX_MANIFEST_BYTES >> 20} MiB; re-export the model"
            )
        raw = path.read_bytes()
        try:
            manifest = cls.from_json(json.loads(raw.decode("utf-8")))
        except UnicodeDecodeError as e:
            raise ArtifactError(f"{path} is not UTF-8 text (byte {e.start}); re-export the model") from None
        except (json.JSONDecodeError, RecursionError) as e:
            raise ArtifactError(f"{path} is not a valid manifest ({e}); re-export the model") from None
        # each file's stat key as checked: graphs.integrity.recheck before a late open
        manifest.checked = verify_files(out_dir, manifest.files, raw, MANIFEST, verify)
        return manifest

    def verify(self, out_dir: Path) -> None:
        """Raise ArtifactError unless ``out_dir`` holds exactly the listed files with their sha256 (full check)."""
        raw = (Path(out_dir) / MANIFEST).read_bytes()
        verify_files(Path(out_dir), self.files, raw, MANIFEST, "full")

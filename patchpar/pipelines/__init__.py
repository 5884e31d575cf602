"""Prompt -> image pipelines."""

from patchpar.pipelines.text2img import Conditioning, Output, Pipeline, load_pipeline

__all__ = ["Conditioning", "Output", "Pipeline", "load_pipeline"]

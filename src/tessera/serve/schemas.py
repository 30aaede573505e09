"""Request and response bodies, as text-embeddings-inference (``/embed``, ``/predict``,
``/info``) and OpenAI (``/v1/embeddings``) define them. Unknown fields are refused by
name rather than ignored, so a misspelt option is never silently dropped."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbedRequest(_Strict):
    inputs: str | list[str] = Field(description="one text or a list of texts")
    normalize: bool = Field(True, description="scale each embedding to unit length")
    truncate: bool = Field(
        False, description="cut inputs longer than the model takes instead of refusing them"
    )
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    prompt_name: str | None = Field(
        None, description="accepted for TEI compatibility; no prompts are configured"
    )


class PredictRequest(_Strict):
    inputs: str | list[str] = Field(description="one text or a list of texts")
    raw_scores: bool = Field(False, description="logits instead of probabilities")
    truncate: bool = False
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"


class Prediction(BaseModel):
    score: float
    label: str


class OpenAIEmbeddingRequest(_Strict):
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, texts, or token ids (one list or a list of lists), as OpenAI takes them"
    )
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, description="keep the first N dimensions (then normalised)")
    user: str | None = None


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


class ErrorResponse(BaseModel):
    error: str
    error_type: str

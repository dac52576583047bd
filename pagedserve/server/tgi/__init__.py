"""Text Generation Inference (TGI) compatibility: TGI's routes, request and response shapes,
launcher flag aliases and metric names, so that TGI clients and dashboards work unchanged."""

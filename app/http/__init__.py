"""The HTTP edge: thin routes, request parsing and checks (deps), request and response models,
errors as JSON, the OpenAPI document, middleware and uploads. Routes parse, call the serving
use case and shape the answer."""

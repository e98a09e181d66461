"""The OpenAI protocol, once for the server and run-batch: the request bodies declared field by field (schema.py,
requests.py, responses_api_requests.py), the answers declared (answers.py, responses_api_answers.py), bodies into
SamplingParams and results into bodies (bodies.py), tool calls, prompts, constraint and limit checks, the /v1/responses
conversion (responses_request.py, responses_output.py) and the table of request fields (field_table.py)."""

"""Tags of discriminated unions (e.g. grader types). Pydantic puts them in an error's location,
but they are not fields the user wrote, so error `param`s leave them out. Kept free of web
imports: schemas that workers import register here."""

UNION_TAGS: set[str] = set()


def register_union_tags(*tags: str) -> None:
    UNION_TAGS.update(tags)

"""Command line: `python -m reshard_ext demo` | `python -m reshard_ext info`."""
import sys


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "info"
    if cmd == "demo":
        from .demo import main as demo

        return demo()
    if cmd == "info":
        import reshard_ext

        print(reshard_ext.build_info())
        return 0
    print("usage: python -m reshard_ext [demo|info]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

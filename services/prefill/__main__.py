"""``python -m services.prefill``"""

from services.prefill.worker import main_entry

if __name__ == "__main__":
    main_entry()

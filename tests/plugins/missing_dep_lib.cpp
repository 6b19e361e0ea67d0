// A library that the missing-dependency test plugin links against and the loader cannot find.
int mt_test_missing_symbol() { return 42; }

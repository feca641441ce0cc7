import unittest

from anagram import find_anagrams


class AnagramTest(unittest.TestCase):
    def test_no_matches(self):
        self.assertEqual(find_anagrams("diaper", ["hello", "world", "zombies"]), [])

    def test_two_anagrams_in_order(self):
        self.assertEqual(find_anagrams("master", ["stream", "pigeon", "maters"]), ["stream", "maters"])

    def test_case_is_ignored_and_kept(self):
        self.assertEqual(find_anagrams("Orchestra", ["cashregister", "Carthorse", "radishes"]), ["Carthorse"])

    def test_a_word_is_not_its_own_anagram(self):
        self.assertEqual(find_anagrams("BANANA", ["Banana"]), [])
